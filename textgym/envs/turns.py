"""The multi-turn half of :class:`~textgym.envs.episodes.Episodes`: with a responder, an agent turn that ends
is closed, the responder answers it (one batched call per step), and its reply is written after the turn into
the same token arrays, marked in ``env_mask``. A mixin of ``Episodes``, whose arrays it uses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from textgym.conversation import AGENT_ROLE, Conversation, Reply, ResponderError
from textgym.envs.conversation import ReplyFormatter
from textgym.envs.responder_calls import notify_end, reply_role, validated_replies
from textgym.rewards import Turn


class Turns:
    """``conversation``, ``end`` and the answering of ended agent turns (see the module doc)."""

    # set by Episodes.__init__; prompt_text and _stop_string are Episodes' too
    tokenizer: Any
    responder: Any
    chat_template: bool
    formatter: ReplyFormatter
    prompts: list[Any]
    prompt_index: np.ndarray
    input_ids: np.ndarray
    attention_mask: np.ndarray
    env_mask: np.ndarray
    length: np.ndarray
    turn_start: np.ndarray
    agent_tokens: np.ndarray
    turns: list[list[Turn]]
    turn_rewards: list[list[float]]
    states: list[dict[str, Any]]
    metas: list[Any]
    seeds: np.ndarray
    open: np.ndarray
    max_turns: int | None
    limit: int
    P: int
    T: int
    eos_id: int
    eos_ids: frozenset[int]

    def _separator(self) -> str:
        """What goes between a prompt and a responder's opening: a blank line, or where the tokenizer cannot
        write one (a small character vocabulary), a space, or nothing."""
        if self.responder is None or self.chat_template:
            return "\n\n"
        for separator in ("\n\n", " "):
            try:
                self.tokenizer.encode(separator)
                return separator
            except ValueError:
                continue
        return ""

    def conversation(self, i: int, last_turn: bool = False) -> Conversation:
        """What the responder sees of slot ``i``'s episode."""
        return Conversation(self.prompt_text(i), self.metas[i], tuple(self.turns[i]), self.states[i],
                            last_turn=last_turn, seed=int(self.seeds[i]))  # fmt: skip

    def end(self, slots: Sequence[int] | np.ndarray) -> None:
        """Tell the responder (its ``end``, when it has one) that the episodes in ``slots`` are over: ended,
        reset before their end, or closed with the env. Each episode once."""
        slots = [int(i) for i in slots if self.open[i]]
        if self.responder is None or not slots:
            return
        self.open[slots] = False
        notify_end(self.responder, [self.conversation(i) for i in slots])

    def _answer(self, rows: np.ndarray, turn_rewards: np.ndarray) -> dict[int, str]:
        """Close the agent turns of ``rows``, ask the responder (one batched call) and write its replies.
        Returns the slots whose episode ended, with their finish reasons."""
        conversations = []
        for i in rows:
            self.turns[i].append(self._agent_turn(i, self.turn_start[i], self.length[i]))
            self.turn_start[i] = self.length[i]
            last = self.max_turns is not None and len(self.turn_rewards[i]) + 1 >= self.max_turns
            # a TimeLimit's last step ended this turn, or the token budget is used up: the agent gets no
            # other turn, as after its max_turns-th
            last = last or bool(self.limit < self.T and self.agent_tokens[i] >= self.limit)
            last = last or bool(self.length[i] >= self.T)
            conversations.append(self.conversation(i, last_turn=last))
        ended: dict[int, str] = {}
        for i, conversation, reply in zip(
            rows, conversations, validated_replies(self.responder, conversations)
        ):
            reward = 0.0 if reply.reward is None else float(reply.reward)
            self.turn_rewards[i].append(reward)
            turn_rewards[i] = reward
            if reply.done:  # finished, or cut short (a wrapped env's time limit): truncated, as at max_turns
                ended[int(i)] = "max_turns" if reply.truncated else "stop"
            elif conversation.last_turn:
                ended[int(i)] = "max_turns"
            elif not self._write_reply(i, reply):
                ended[int(i)] = "overflow"
        return ended

    def _write_reply(self, i: int, reply: Reply) -> bool:
        """Write ``reply`` after slot ``i``'s agent turn; False when it had to be cut at the token budget."""
        role = reply_role(reply, self.responder)
        ending = self._turn_ending(i)
        try:
            ids = self.formatter.encode(role, reply.text, ending)
        except ValueError as exc:  # e.g. a character outside a small vocabulary
            raise ResponderError(
                f"responder {self.responder.name!r} replied {reply.text[:60]!r}, which the env's tokenizer "
                f"cannot encode: {exc}"
            ) from None
        room = self.T - self.length[i]
        fits = len(ids) < room  # the agent needs room for at least one more token
        ids = ids[:room]
        start = self.P + self.length[i]
        self.input_ids[i, start : start + len(ids)] = ids
        self.attention_mask[i, start : start + len(ids)] = 1
        self.env_mask[i, start : start + len(ids)] = 1
        self.length[i] += len(ids)
        self.turn_start[i] = self.length[i]
        # a reply cut at the budget is recorded as what was written: what the agent saw, and what a reward reads
        text = reply.text if fits else self.formatter.written(role, ids, reply.text, ending)
        self.turns[i].append(Turn(role, text, tuple(int(t) for t in ids)))
        return fits

    def _turn_ending(self, i: int) -> str | None:
        """The text that ended slot ``i``'s last agent turn: the EOS token, or the stop string it wrote."""
        ids = self.turns[i][-1].token_ids
        if ids and ids[-1] == self.eos_id:
            return getattr(self.tokenizer, "eos_token", None)
        if ids and ids[-1] in self.eos_ids:  # another end id the model declares (<|eot_id|>)
            return self.tokenizer.decode([ids[-1]])
        return self._stop_string(list(ids))

    def _agent_turn(self, i: int, start: int, end: int) -> Turn:
        """The agent's turn in response positions ``[start, end)``: its text without EOS (stop strings kept)."""
        ids = self.input_ids[i, self.P + start : self.P + end]
        body = ids[:-1] if len(ids) and ids[-1] in self.eos_ids else ids
        return Turn(AGENT_ROLE, self.agent_text(body), tuple(int(t) for t in ids))
