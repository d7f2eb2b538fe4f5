"""The state both env classes share: N generation slots in fixed-size arrays, and their scoring. The
multi-turn half (a responder's replies between agent turns) is the :class:`~textgym.envs.turns.Turns` mixin,
a prompt's text to the ids an episode starts from the :class:`~textgym.envs.prompt_ids.PromptIds` one."""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
from gymnasium import spaces
from gymnasium.error import InvalidAction

from textgym.conversation import AGENT_ROLE, ResponderError, is_environment_role
from textgym.envs.conversation import ReplyFormatter
from textgym.envs.prompt_ids import PromptIds
from textgym.envs.responder_calls import validated_openings
from textgym.envs.turns import Turns
from textgym.errors import ConfigError, PromptError
from textgym.models import check_pad_token, declared_eos_ids, load_tokenizer, with_pad_token
from textgym.prompts import Prompt, PromptsLike, load_prompts
from textgym.responders import ResponderSpec, make_responder
from textgym.reward_functions import RewardExtras, add_to_sums, reward_log
from textgym.rewards import ENDED_ON_A_TOKEN, RewardSpec, RewardStack, Sample, Turn, build_reward_stack

MAX_OBSERVATION_BYTES = 2**31
DEFAULT_REWARDS: list[dict[str, Any]] = [
    {"name": "sentiment", "weight": 1.0},
    {"name": "length_penalty", "weight": 0.5, "target": 24},
]


class StepResult(NamedTuple):
    """What one step did to the episodes: which ended and why, and which agent turns ended with what reward."""

    ended: np.ndarray  # slots whose episode ended
    reasons: list[str]  # their finish reasons
    turn_ended: np.ndarray  # slots whose agent turn ended on this step (multi-turn), ended episodes included
    turn_rewards: np.ndarray  # (n,) the reward of each turn that ended, 0 elsewhere


class Episodes(PromptIds, Turns):
    """``n`` episodes in lockstep: prompt left-padded into ``[0, P)``, completion written into ``[P, P+T)``.

    With a responder, ``[P, P+T)`` holds the whole conversation after the prompt: agent turns and the
    environment's replies, back to back; ``env_mask`` marks the positions the environment wrote.

    Args: see :class:`textgym.envs.TextGenEnv`.
    """

    def __init__(
        self,
        n: int,
        model: Any = None,
        prompts: PromptsLike = None,
        rewards: RewardStack | Sequence[RewardSpec] | None = None,
        max_new_tokens: int = 32,
        max_prompt_tokens: int = 96,
        chat_template: bool | None = None,
        stop: Sequence[str] | str | None = None,
        prompt_overflow: str = "truncate",
        prompt_order: str = "random",
        allowed_tokens: Sequence[str | int] | str | None = None,
        pad_token: str | None = None,
        responder: ResponderSpec = None,
        max_turns: int | None = None,
    ):
        for arg, value in (("max_new_tokens", max_new_tokens), ("max_prompt_tokens", max_prompt_tokens)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ConfigError(f"{arg} must be a positive integer, not {value!r}.")
        if prompt_overflow not in ("truncate", "error"):
            raise ConfigError(f"prompt_overflow must be 'truncate' or 'error', not {prompt_overflow!r}.")
        if prompt_order not in ("random", "sequential"):
            raise ConfigError(f"prompt_order must be 'random' or 'sequential', not {prompt_order!r}.")
        self.tokenizer = load_tokenizer(model if model is not None else "smollm2-135m-instruct")
        if pad_token is not None:
            self.tokenizer = with_pad_token(self.tokenizer, pad_token)
        check_pad_token(self.tokenizer)
        self.prompts: list[Prompt] = load_prompts(prompts)
        self.n_source = len(self.prompts)  # texts passed in options["prompt"] go after these, never drawn
        self._adhoc: dict[str, int] = {}
        self.responder = make_responder(responder)
        role = getattr(self.responder, "role", "user")
        if not is_environment_role(role):  # else refused at its first reply
            raise ConfigError(
                f"responder {getattr(self.responder, 'name', '?')!r} has role {role!r}; its replies' role is the "
                f'environment\'s ("user", "tool", ...), never the agent\'s {AGENT_ROLE!r}.'
            )
        if max_turns is not None and (
            not isinstance(max_turns, (int, np.integer)) or isinstance(max_turns, bool) or max_turns < 1
        ):
            raise ConfigError(f"max_turns must be a positive integer or None (no limit), not {max_turns!r}.")
        if max_turns not in (None, 1) and self.responder is None:
            raise ConfigError(
                f"max_turns={max_turns} needs a responder: without one an episode has a single turn. Give "
                f"responder='...' (`textgym plugins` lists them) or leave max_turns out."
            )
        self.max_turns = None if max_turns is None else int(max_turns)
        # With a responder the turn rewards can be the whole training signal: a stack of metrics only is fine.
        self.stack = build_reward_stack(
            DEFAULT_REWARDS if rewards is None else rewards, allow_all_metrics=self.responder is not None
        )
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if chat_template and not has_template:
            raise ConfigError(
                f"chat_template=True, but the tokenizer {type(self.tokenizer).__name__} has none: leave "
                f"chat_template unset (or false) to give the prompts as plain text."
            )
        self.chat_template = has_template if chat_template is None else bool(chat_template)
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, not {self.stop!r}.")
        # tokens that may hold a stop string: one per UTF-8 byte at most (a byte-level BPE takes up to 4 per
        # character; counted in characters, "答案：" never fit and its episodes ran on to the token limit)
        self._stop_window = max((len(s.encode("utf-8")) for s in self.stop), default=0) + 2
        self.prompt_overflow, self.prompt_order = prompt_overflow, prompt_order

        self.n, self.P, self.T = n, int(max_prompt_tokens), int(max_new_tokens)
        self.limit = self.T  # steps before truncation: max_new_tokens, or less under a TimeLimit
        if n * (self.P + self.T) * 9 > MAX_OBSERVATION_BYTES:  # refuse before allocating
            raise ConfigError(
                f"{n} sub-envs x (max_prompt_tokens + max_new_tokens = {self.P + self.T}) tokens would need "
                f"{n * (self.P + self.T) * 9 / 2**30:.1f} GiB for observations; lower them."
            )
        self.vocab_size = len(self.tokenizer)
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        # Every id that ends an episode as EOS does: the tokenizer's, and those a model directory declares
        # (Llama 3's and Gemma's end-of-turn token), which the env ran past to the token limit. Never pad.
        declared = declared_eos_ids(model) if model is not None else set()
        self.eos_ids = frozenset(
            i for i in {self.eos_id, *declared} if i is not None and i != self.pad_id and i < self.vocab_size
        )
        self._eos_array = np.array(sorted(self.eos_ids), dtype=np.int64)
        # the special tokens a completion's text leaves out: EOS, and stop strings that are special tokens
        # (<|im_end|>). Any other the policy wrote (a pad, <|im_start|>) stays in it: a reward reads what was
        # written ("a<pad>bc" is no copy of "abc"), where skipping them all hid it
        specials = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        self._hidden_ids = set(self.eos_ids) | (self._token_ids(self.stop) & specials)
        L = self.P + self.T
        self.input_ids = np.full((n, L), self.pad_id, dtype=np.int64)  # (N, L)
        self.attention_mask = np.zeros((n, L), dtype=np.int8)  # (N, L)
        self.prompt_index = np.zeros(n, dtype=np.int64)
        self.length = np.zeros(n, dtype=np.int64)  # new tokens so far
        self.active = np.zeros(n, dtype=bool)
        # multi-turn bookkeeping, per slot
        self.env_mask = np.zeros((n, L), dtype=np.int8)  # (N, L) 1 where the environment wrote
        # the response position where the agent's current turn began
        self.turn_start = np.zeros(n, dtype=np.int64)
        self.agent_tokens = np.zeros(n, dtype=np.int64)  # actions so far
        self.turns: list[list[Turn]] = [[] for _ in range(n)]
        self.turn_rewards: list[list[float]] = [[] for _ in range(n)]
        self.states: list[dict[str, Any]] = [{} for _ in range(n)]
        # each episode's own copy of its prompt's metadata, for the responder: what it changes there (a list
        # of follow-up questions it pops) stays in the episode instead of reaching the prompt's next ones
        self.metas: list[Any] = [{} for _ in range(n)]
        self.seeds = np.zeros(n, dtype=np.int64)  # each episode's seed for its responder (Conversation.seed)
        self.open = np.zeros(n, dtype=bool)  # episodes the responder has not been told the end of (end())
        self.openings: list[str | None] = [None] * n
        self.separator = self._separator()
        self.formatter = ReplyFormatter(self.tokenizer, self.chat_template)
        self._encoded: dict[int, np.ndarray] = {}
        self.cursor = 0  # draws made in the sequential order (modulo the source's size)
        self.shard = (0, 1)  # (process, processes): a data-parallel process's every processes-th prompt
        self.reward_seconds = 0.0  # time spent in the reward stack, for agents' time breakdowns
        self.reward_metrics: dict[str, tuple[float, int]] = {}  # TRL-style functions' log_metric: sum, count

        self.observation_space = spaces.Dict(
            {
                "input_ids": spaces.Box(0, self.vocab_size - 1, shape=(L,), dtype=np.int64),
                "attention_mask": spaces.Box(0, 1, shape=(L,), dtype=np.int8),
            }
        )
        self.action_space = spaces.Discrete(self.vocab_size)
        self.allowed = self._allowed_mask(allowed_tokens)
        self._overflowed = 0
        if len(self.prompts) <= 10_000:  # a prompt the tokenizer cannot encode fails now, not mid-training
            for index in range(len(self.prompts)):
                self.encode_prompt(index, warn=False)
            if self._overflowed:
                warnings.warn(
                    f"{self._overflowed} of {len(self.prompts)} prompts have more than max_prompt_tokens={self.P} "
                    f"tokens; keeping the end of each one's text, inside its chat template or special tokens. Raise "
                    f"max_prompt_tokens to keep them whole.",
                    stacklevel=3,
                )

    def _token_ids(self, texts: Sequence[str]) -> set[int]:
        """The ids of those ``texts`` that are one token of the vocabulary (``convert_tokens_to_ids`` gives
        the unknown token's id for any other, which then passed for a stop token)."""
        convert = getattr(self.tokenizer, "convert_tokens_to_ids", None)
        back = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        if convert is None or back is None:
            return set()
        return {i for t in texts if isinstance(i := convert(t), int) and back(i) == t}

    def _allowed_mask(self, allowed: Sequence[str | int] | str | None) -> np.ndarray:
        """(V,) bool: every token but pad, or only ``allowed`` (token ids, token strings, or a string of
        characters each encoded alone) and EOS."""
        mask = np.zeros(self.vocab_size, dtype=bool)
        if allowed is None:
            mask[:] = True
        else:
            if isinstance(allowed, (int, np.integer, bytes)) or not isinstance(allowed, Iterable):
                raise ConfigError(
                    f"allowed_tokens must be a list of token ids or token strings, or a string of characters, "
                    f"not {allowed!r}."
                )
            items = list(allowed)  # a string is its characters
            for item in items:
                if (
                    isinstance(item, (int, np.integer))
                    and not isinstance(item, bool)
                    and 0 <= item < self.vocab_size
                ):
                    mask[int(item)] = True
                    continue
                ids = self.tokenizer.encode(item, add_special_tokens=False) if isinstance(item, str) else []
                if len(ids) != 1:
                    raise ConfigError(
                        f"allowed_tokens: {item!r} is not one token of this vocabulary (give a token as its text, "
                        f"e.g. ' yes' with its leading space, not as the vocabulary writes it, e.g. 'Ġyes')."
                    )
                mask[ids[0]] = True
            mask[list(self.eos_ids)] = True
        if self.pad_id != self.eos_id:
            mask[self.pad_id] = False  # padding is never an action
        return mask

    # -- prompts (their ids: PromptIds) --------------------------------------------------------------
    def prompt_text(self, i: int) -> str:
        """Slot ``i``'s prompt text, with the responder's opening when ``start`` gave one."""
        text = self.prompts[self.prompt_index[i]].text
        return text if self.openings[i] is None else f"{text}{self.separator}{self.openings[i]}"

    def draw(self, k: int, rng: np.random.Generator) -> list[int]:
        """The indices of the next ``k`` prompts, in ``prompt_order``. Sequential draws of process ``p`` of
        ``P`` (``shard``) are prompts p, p + P, p + 2P, ... (cycling), so processes in step draw different ones."""
        if self.prompt_order == "sequential":
            process, processes = self.shard
            indices = [(process + processes * (self.cursor + j)) % self.n_source for j in range(k)]
            self.cursor = (self.cursor + k) % self.n_source
            return indices
        return [int(rng.integers(self.n_source)) for _ in range(k)]

    def start(
        self,
        slots: Sequence[int] | np.ndarray,
        rng: np.random.Generator,
        prompts: Sequence[Any] | None = None,
        group: int = 1,
    ) -> None:
        """Begin new episodes in ``slots``: ``prompts[k]`` (a prompt index or a text) in ``slots[k]``, or the
        next prompts of the source when ``prompts`` is None. With a responder each episode gets a seed from
        ``rng``, one per ``group`` consecutive slots (a group method's completions of one prompt play one
        game)."""
        slots = list(slots)
        self.end(slots)  # episodes reset before they ended
        indices = self.draw(len(slots), rng) if prompts is None else [self.prompt_option(p) for p in prompts]
        for slot, index in zip(slots, indices):
            self.prompt_index[slot], self.length[slot], self.active[slot] = index, 0, True
            self.turn_start[slot] = self.agent_tokens[slot] = 0
            self.turns[slot], self.turn_rewards[slot], self.states[slot] = [], [], {}
            self.openings[slot] = None
            self.env_mask[slot] = 0
        if self.responder is not None and slots:
            for slot in slots:
                self.metas[slot] = copy.deepcopy(self.prompts[self.prompt_index[slot]].meta)
            seeds = rng.integers(2**32, size=-(-len(slots) // group), dtype=np.int64)
            self.seeds[slots] = np.repeat(seeds, group)[: len(slots)]
            self.open[slots] = True
            conversations = [self.conversation(i) for i in slots]
            for slot, opening in zip(slots, validated_openings(self.responder, conversations)):
                self.openings[slot] = opening or None
        for slot in slots:
            index = self.prompt_index[slot]
            ids = self.encode_prompt(index) if self.openings[slot] is None else self._with_opening(slot)
            self.input_ids[slot] = self.pad_id
            self.attention_mask[slot] = 0
            self.input_ids[slot, self.P - len(ids) : self.P] = ids
            self.attention_mask[slot, self.P - len(ids) : self.P] = 1

    def _with_opening(self, slot: int) -> np.ndarray:
        """Slot ``slot``'s prompt with its responder's opening, encoded. Where that fails and the prompt alone
        does not (a text the tokenizer cannot write, a prompt made too long), the opening is named."""
        index = self.prompt_index[slot]
        try:
            return self._encode(self.prompt_text(slot), index)
        except PromptError as exc:
            self.encode_prompt(index)  # the prompt alone: its own error, if the prompt is what fails
            opening = str(self.openings[slot])
            raise ResponderError(
                f"responder {self.responder.name!r}: the opening its start() gave {self._which(index)} "
                f"({opening[:40]!r}{'...' if len(opening) > 40 else ''}) cannot go into the episode: {exc}"
            ) from None

    def prompt_option(self, prompt: Any) -> int:
        """The prompt index for a ``reset`` option: an index into the source, or a text: the source's first
        prompt of that text (with its metadata), else a prompt without metadata, added on first use."""
        if (
            isinstance(prompt, (int, np.integer))
            and not isinstance(prompt, bool)
            and 0 <= prompt < self.n_source
        ):
            return int(prompt)
        if isinstance(prompt, str) and prompt.strip():
            if not self._adhoc:  # a source prompt's text is that prompt, with its metadata (a reference)
                self._adhoc.update((p.text, i) for i, p in reversed(list(enumerate(self.prompts))))
            if prompt not in self._adhoc:
                self._adhoc[prompt] = len(self.prompts)
                self.prompts.append(Prompt(prompt))
            return self._adhoc[prompt]
        raise ConfigError(
            f"a prompt option must be a prompt index in [0, {self.n_source}) or a non-empty text, not {prompt!r}."
        )

    # -- stepping --------------------------------------------------------------------------------------
    def append(self, actions: np.ndarray) -> StepResult:
        """Append one token to every active episode; with a responder, answer the turns that ended."""
        rows = np.flatnonzero(self.active)
        tokens = actions[rows]
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if bad.any():
            k = int(np.argmax(bad))
            raise InvalidAction(
                f"action {tokens[k]} (env {rows[k]}) is not a token id: actions must be in "
                f"[0, {self.vocab_size}) for this vocabulary."
            )
        cols = self.P + self.length[rows]
        self.input_ids[rows, cols] = tokens
        self.attention_mask[rows, cols] = 1
        self.length[rows] += 1
        self.agent_tokens[rows] += 1
        stopped = np.isin(tokens, self._eos_array)
        if self.stop:
            stopped |= np.array([self._hit_stop(i) for i in rows], dtype=bool)
        # the token budget counts every token after the prompt; a TimeLimit (``limit``) counts actions
        full = (self.length[rows] >= self.T) | (self.agent_tokens[rows] >= self.limit)
        turn_rewards = np.zeros(self.n)
        if self.responder is None:
            ended = stopped | full
            self.active[rows[ended]] = False
            reasons = ["stop" if s else "length" for s in stopped[ended]]
            return StepResult(rows[ended], reasons, rows[:0], turn_rewards)
        finished: dict[int, str] = {int(i): "length" for i in rows[full & ~stopped]}
        turn_rows = rows[stopped]
        if len(turn_rows):
            finished.update(self._answer(turn_rows, turn_rewards))
        ended = np.array(sorted(finished), dtype=np.int64)
        self.active[ended] = False
        return StepResult(ended, [finished[i] for i in ended], turn_rows, turn_rewards)

    def _hit_stop(self, i: int) -> bool:
        turn = self.input_ids[i, self.P + self.turn_start[i] : self.P + self.length[i]]  # this agent turn
        return self._stop_string(turn) is not None

    def _stop_string(self, ids: Sequence[int] | np.ndarray) -> str | None:
        """The stop string in the text of the last tokens of an agent turn's ``ids``, if one is there. A
        window that starts inside a character decodes to U+FFFD there, and a byte-fallback decoder (Llama 2,
        Mistral, Gemma) makes the whole run of byte tokens after it U+FFFD, the stop string's own bytes too:
        the window then reaches back to the character's start, at most 3 more tokens."""
        window = self._stop_window
        tail = self.tokenizer.decode(ids[-window:])
        while tail.startswith("\ufffd") and window < min(len(ids), self._stop_window + 3):
            window += 1
            tail = self.tokenizer.decode(ids[-window:])
        return next((s for s in self.stop if s in tail), None)

    def agent_text(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of an agent's tokens: every token as written but EOS and special-token stop strings."""
        return self.tokenizer.decode([int(t) for t in ids if int(t) not in self._hidden_ids])

    def sample(self, i: int, finish_reason: str) -> Sample:
        turns: tuple[Turn, ...] = ()
        if self.responder is None:
            completion_ids = self.input_ids[i, self.P : self.P + self.length[i]]
        else:  # the completion is the agent's last turn; a turn cut at the budget is one too
            if self.length[i] > self.turn_start[i]:
                self.turns[i].append(self._agent_turn(i, self.turn_start[i], self.length[i]))
                self.turn_start[i] = self.length[i]
            turns = tuple(self.turns[i])
            last = next((t for t in reversed(turns) if t.role == AGENT_ROLE), Turn(AGENT_ROLE, ""))
            completion_ids = np.asarray(last.token_ids, dtype=np.int64)
        body = (
            completion_ids[:-1]
            if len(completion_ids) and completion_ids[-1] in self.eos_ids and finish_reason != "length"
            else completion_ids
        )
        text = self.agent_text(body)
        whole = len(text)
        for s in self.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        kept = len(body)
        if len(text) < whole:  # a stop string ended it: its tokens are the ones past the text
            while kept and len(self.agent_text(body[:kept])) > len(text):
                kept -= 1
        elif self.stop and finish_reason in ENDED_ON_A_TOKEN:  # a stop string that is a special token
            full = self.tokenizer.decode(body)
            cut = min((full.find(s) for s in self.stop if s in full), default=-1)
            if cut >= 0:
                while kept and len(self.tokenizer.decode(body[:kept])) > cut:
                    kept -= 1
                text = self.agent_text(body[:kept])
        prompt = self.prompts[self.prompt_index[i]]
        prompt_ids = self.input_ids[i, : self.P][self.attention_mask[i, : self.P] == 1]
        return Sample(
            prompt=self.prompt_text(i),
            completion=text,
            prompt_ids=tuple(prompt_ids.tolist()),
            completion_ids=tuple(completion_ids.tolist()),
            finish_reason=finish_reason,  # type: ignore[arg-type]
            # a multi-turn episode's own copy, as its responder left it (a secret its game drew in start())
            meta=self.metas[i] if self.responder is not None else prompt.meta,
            turns=turns,
            stop_tokens=len(completion_ids) - kept,
        )

    def finish(self, slots: np.ndarray, reasons: list[str]) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """Score the episodes that ended in ``slots`` in one batched call: rewards and their infos."""
        samples = [self.sample(i, r) for i, r in zip(slots, reasons)]
        start = time.perf_counter()
        with reward_log() as log:  # what TRL-style functions log through log_metric and log_extra
            total, components = self.stack.score(samples)
        self.reward_seconds += time.perf_counter() - start
        for name, (total_logged, count) in log.metrics.items():
            add_to_sums(self.reward_metrics, name, total_logged, count)
        infos = [
            {
                "reward_components": {name: float(v[k]) for name, v in components.items()},
                "completion": s.completion,
                "finish_reason": s.finish_reason,
                "prompt": s.prompt,
                "num_tokens": len(s.completion_ids),
            }
            for k, s in enumerate(samples)
        ]
        if log.extras:  # every episode of the batch has every column (None where a function gave none)
            for info, s in zip(infos, samples):
                info["reward_extras"] = RewardExtras(
                    {column: values.get(id(s)) for column, values in log.extras.items()}
                )
        if self.responder is not None:
            self.end(slots)
            for i, info, s in zip(slots, infos, samples):
                info["num_tokens"] = int(self.agent_tokens[i])  # every action of the episode
                info["turns"] = [
                    {"role": t.role, "text": t.text, "tokens": len(t.token_ids)} for t in s.turns
                ]
                info["turn_rewards"] = list(self.turn_rewards[i])
                info["env_token_mask"] = self.env_mask[i].copy()
        return total, infos

    def obs(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids[i].copy(), "attention_mask": self.attention_mask[i].copy()}

    def batch_obs(self) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids.copy(), "attention_mask": self.attention_mask.copy()}

    def text(self, i: int) -> str:
        ids = self.input_ids[i][self.attention_mask[i] == 1]
        return self.tokenizer.decode(ids)
