"""Adapter from the native :class:`~textgym.envs.TextGenVectorEnv` to Stable-Baselines3's ``VecEnv``.

``make_vec_env("textgym/Copy-v0", n_envs=8)`` gives a VecEnv that SB3's algorithms train on directly, with
the vector env's batched reward scoring kept (one reward call per step for all episodes that end on it).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvStepReturn

from textgym.envs import TextGenVectorEnv
from textgym.errors import ConfigError
from textgym.models import seeded_sampling

SINGLE_SPACES = {"observation_space": "single_observation_space", "action_space": "single_action_space"}
# safe to call for a subset of sub-envs: their rows are read, and nothing changes
READ_ONLY_METHODS = ("action_masks", "render")


class TextGymVecEnv(VecEnv):
    """SB3 ``VecEnv`` over a ``TextGenVectorEnv`` in ``"SameStep"`` autoreset mode.

    Episode ends follow SB3's conventions: ``infos[i]["terminal_observation"]`` holds the last observation,
    ``infos[i]["TimeLimit.truncated"]`` is always False (see :meth:`step_wait`), ``infos[i]["episode"]``
    holds the episode's return, length and duration as ``Monitor`` writes them (so ``evaluate_policy`` and
    ``EvalCallback`` read true episode returns without a Monitor wrapper, and say so), and the info of an
    ended episode also carries ``reward_components``, ``completion`` and ``finish_reason``.
    ``action_masks()`` serves sb3-contrib's ``MaskablePPO``: tokens outside the env's ``allowed_tokens``
    (and pad) are masked. The infos of other steps carry what the env's vector infos hold for that sub-env
    (a multi-turn env's ``turn_reward`` and ``env_token_mask``), and ``reset_infos`` each sub-env's prompt.
    """

    def __init__(self, env: TextGenVectorEnv):
        if env.autoreset_mode is not gym.vector.AutoresetMode.SAME_STEP:
            raise ConfigError("TextGymVecEnv needs a TextGenVectorEnv with autoreset_mode='SameStep'.")
        self.env = env
        super().__init__(env.num_envs, env.single_observation_space, env.single_action_space)
        self._actions: np.ndarray | None = None
        self._created = time.perf_counter()  # Monitor's "t": seconds since then, at each episode's end
        self._returns = np.zeros(env.num_envs)  # a multi-turn episode's turn rewards add up before its end

    def reset(self) -> dict[str, np.ndarray]:
        seed = self._seeds[0] if self._seeds else None
        options = self._vector_options()
        obs, info = self.env.reset(seed=seed, options=options)
        self.reset_infos = [_row(info, i) for i in range(self.num_envs)]
        # a partial reset (options' reset_mask) starts new episodes in its rows only: the others' go on
        mask = (options or {}).get("reset_mask")
        self._returns[slice(None) if mask is None else np.asarray(mask, dtype=bool)] = 0.0
        self._reset_seeds()
        self._reset_options()
        return obs

    def _vector_options(self) -> dict[str, Any] | None:
        """The vector env's reset options from SB3's per-sub-env ones (``set_options``): one dict given to
        every sub-env as it is; a ``prompt`` for each, as the vector env's ``prompts``."""
        options = self._options
        if all(o == options[0] for o in options):
            return options[0] or None
        if all(o and set(o) == {"prompt"} for o in options):
            return {"prompts": [o["prompt"] for o in options]}
        raise ConfigError(
            f"set_options gave the sub-envs different options ({str(options)[:120]}): the vector env resets "
            f"them with one options dict. Give each sub-env a {{'prompt': ...}} alone, or the same dict to all "
            f"(such as {{'prompts': [...]}} with one prompt per sub-env)."
        )

    def step_async(self, actions: np.ndarray) -> None:
        array = np.asarray(actions)
        # a float was cut to an int (1.7: EOS), and a wrong count failed in numpy's reshape
        if array.size != self.num_envs or array.dtype.kind not in "iu":
            from gymnasium.error import InvalidAction

            raise InvalidAction(
                f"actions must be {self.num_envs} integer token ids, one per sub-env, not {array.dtype} of shape "
                f"{array.shape}: {str(array.tolist())[:80]}."
            )
        self._actions = array.reshape(self.num_envs).astype(np.int64)

    def step_wait(self) -> VecEnvStepReturn:
        """SB3's step. ``TimeLimit.truncated`` is False even where the env truncates (``max_new_tokens``, a
        ``TimeLimit``): a textgym episode is scored whole on its last step, a cut one included, so the env
        reports it terminated as well and there is no return after it. With the flag SB3 would add
        ``gamma * V(terminal_observation)`` to that reward: an estimate for a state that has no future, which
        nothing trains towards zero."""
        obs, rewards, terminated, truncated, vinfo = self.env.step(self._actions)
        dones = terminated | truncated
        self._returns += rewards
        infos: list[dict[str, Any]] = [_row(vinfo, i) for i in range(self.num_envs)]
        for i in np.flatnonzero(dones):
            self.reset_infos[i] = infos[i]  # the next episode's (SameStep: it started on this step)
            final = vinfo["final_info"]
            infos[i] = _ended(final, i)
            infos[i]["terminal_observation"] = vinfo["final_obs"][i]
            infos[i]["TimeLimit.truncated"] = False
            infos[i]["episode"] = {
                "r": float(self._returns[i]),
                "l": int(final["num_tokens"][i]),
                "t": round(time.perf_counter() - self._created, 6),
            }
            self._returns[i] = 0.0
        return obs, rewards.astype(np.float32), dones, infos

    def close(self) -> None:
        self.env.close()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        # a sub-env's spaces are the vector env's single ones, not the batched ones
        name = SINGLE_SPACES.get(attr_name, attr_name)
        value = getattr(self.env, name)
        rows = list(self._get_indices(indices))
        if isinstance(value, np.ndarray) and value.shape[:1] == (self.num_envs,):  # per sub-env: its row
            return [value[i] for i in rows]  # (active, env_token_mask)
        return [value] * len(rows)

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        if sorted(self._get_indices(indices)) != list(range(self.num_envs)):
            raise ConfigError(
                f"set_attr({attr_name!r}, indices={indices!r}): the {self.num_envs} sub-envs are one "
                f"TextGenVectorEnv, whose attributes they share; set it on all of them (indices=None)."
            )
        setattr(self.env, attr_name, value)

    def env_method(
        self, method_name: str, *args: Any, indices: VecEnvIndices = None, **kwargs: Any
    ) -> list[Any]:
        rows = list(self._get_indices(indices))
        if sorted(rows) != list(range(self.num_envs)) and method_name not in READ_ONLY_METHODS:
            # the vector env's method acts on every sub-env (env_method("reset", indices=[0]) reset all)
            raise ConfigError(
                f"env_method({method_name!r}, indices={indices!r}): the {self.num_envs} sub-envs are one "
                f"TextGenVectorEnv, whose methods act on all of them; call it on all of them (indices=None)."
            )
        result = getattr(self.env, method_name)(*args, **kwargs)
        # one row per sub-env (action_masks' array, render's tuple of texts): each sub-env gets its own
        if isinstance(result, (np.ndarray, tuple, list)) and len(result) == self.num_envs:
            return [result[i] for i in rows]
        return [result] * len(rows)

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        from stable_baselines3.common.monitor import Monitor

        # The episode infos are Monitor's (see the class docstring): true returns, whatever wraps this env.
        return [wrapper_class is Monitor] * len(self._get_indices(indices))

    def action_masks(self) -> np.ndarray:
        """(n_envs, vocab) bool: the tokens an agent may choose (sb3-contrib's MaskablePPO calls this)."""
        return self.env.action_masks()

    def get_images(self) -> Sequence[np.ndarray | None]:
        return [None] * self.num_envs

    def _get_indices(self, indices: VecEnvIndices) -> Iterable[int]:
        if indices is None:
            return range(self.num_envs)
        return [indices] if isinstance(indices, int) else indices


def _row(vinfo: dict[str, Any], i: int) -> dict[str, Any]:
    """Sub-env ``i``'s entries of a Gymnasium vector info: those its ``_key`` masks mark."""
    row = {}
    for key, values in vinfo.items():
        mask = vinfo.get(f"_{key}")
        if not key.startswith(("_", "final_")) and not isinstance(values, dict) and (mask is None or mask[i]):
            row[key] = values[i]
    if "reward_extras" in row:  # a RewardExtras mapping: a plain dict, as SB3's infos hold values
        row["reward_extras"] = dict(row["reward_extras"])
    return row


def _ended(vinfo: dict[str, Any], i: int) -> dict[str, Any]:
    """Sub-env ``i``'s ended episode, from the vector info that holds it (``final_info`` in SameStep mode):
    its entries, with its reward components."""
    row = _row(vinfo, i)  # an entry only some of the ended sub-envs have (a turn_reward) is left out
    row["reward_components"] = {
        k: v[i] for k, v in vinfo["reward_components"].items() if not k.startswith("_")
    }
    return row


# SB3's make_vec_env arguments that shape a VecEnv of copies, with what to do here instead
_MONITOR = (
    "Its episode infos are Monitor's already; for Monitor's CSV file, wrap it: "
    "VecMonitor(make_vec_env(...), filename=...)."
)
_COPIES = (
    "For per-copy wrappers or worker processes, use SB3's own make_vec_env with the id that imports textgym: "
    "make_vec_env('textgym:textgym/Copy-v0', n_envs=..., wrapper_class=..., vec_env_cls=SubprocVecEnv)."
)
SB3_VEC_ENV_ARGUMENTS = {"monitor_dir": _MONITOR, "monitor_kwargs": _MONITOR, "wrapper_class": _COPIES,
                         "wrapper_kwargs": _COPIES, "vec_env_cls": _COPIES, "vec_env_kwargs": _COPIES,
                         "start_index": _COPIES}  # fmt: skip


def make_vec_env(
    env_id: str = "textgym/TextGen-v0",
    n_envs: int = 8,
    seed: int | None = None,
    env_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> TextGymVecEnv:
    """An SB3 VecEnv of ``n_envs`` episodes of a registered textgym env. The env's settings override its
    defaults, given as keywords or, as SB3's ``make_vec_env`` takes them, in ``env_kwargs``."""
    import textgym  # noqa: F401  (registers the envs)

    sb3_only = sorted(set(kwargs) & set(SB3_VEC_ENV_ARGUMENTS))
    if sb3_only:  # they reached the env, which failed on them with a TypeError about itself
        raise ConfigError(
            f"textgym.sb3.make_vec_env does not take SB3's {', '.join(sb3_only)}: it makes one batched env, "
            f"not a VecEnv of wrapped copies. {SB3_VEC_ENV_ARGUMENTS[sb3_only[0]]}"
        )
    both = sorted(set(env_kwargs or {}) & set(kwargs))
    if both:
        raise ConfigError(f"make_vec_env got {both} both as keywords and in env_kwargs: give each once.")
    kwargs = {**(env_kwargs or {}), **kwargs}

    env = gym.make_vec(env_id, num_envs=n_envs, vectorization_mode="vector_entry_point", **kwargs)
    env = env.unwrapped if hasattr(env, "unwrapped") else env
    if not isinstance(env, TextGenVectorEnv):
        raise ConfigError(
            f"{env_id} made a {type(env).__name__}, not a TextGenVectorEnv: make_vec_env adapts textgym's envs "
            f"(for another env, use SB3's own make_vec_env)."
        )
    vec = TextGymVecEnv(env)
    if seed is not None:
        vec.seed(seed)
    return vec


# -- SB3 agents in textgym run directories ------------------------------------------------------------
SB3_MODEL = "model.zip"


class Predictor:
    """An SB3-style model's ``predict`` over the steps of its episodes, called as its own rollouts call it:
    with the env's action masks where ``predict`` takes them (sb3-contrib's ``MaskablePPO``: without them it
    sampled the tokens it had learnt never to take) and with a recurrent policy's state carried from step to
    step, restarted where an episode starts (``RecurrentPPO``: without it the LSTM restarted at every
    token). Other models ignore the state."""

    def __init__(self, model: Any, num_envs: int):
        self.model = model
        parameters = inspect.signature(model.predict).parameters
        self.masked = takes_action_masks(model)
        self.stateful = "state" in parameters and "episode_start" in parameters  # a plain predict(obs) too
        self.state: Any = None
        self.starts = np.ones(num_envs, dtype=bool)

    def __call__(self, obs: Any, env: Any, deterministic: bool) -> np.ndarray:
        kwargs: dict[str, Any] = {"action_masks": env.action_masks()} if self.masked else {}
        if self.stateful:
            kwargs.update(state=self.state, episode_start=self.starts)
        actions, state = self.model.predict(obs, deterministic=deterministic, **kwargs)
        self.state, self.starts = state, np.zeros_like(self.starts)
        return np.asarray(actions)

    def ended(self, dones: np.ndarray) -> None:
        """The sub-envs whose episode ended: the next step starts a new one there."""
        self.starts = np.asarray(dones, dtype=bool).copy()


def takes_action_masks(model: Any) -> bool:
    """Whether ``model.predict`` takes the env's action masks (sb3-contrib's ``MaskablePPO``)."""
    return "action_masks" in inspect.signature(model.predict).parameters


def sb3_row(info: dict[str, Any], reward: float) -> dict[str, Any]:
    """An ended episode as the sample tables and files hold it (a multi-turn one with its turns and turn
    rewards, as an LM agent's)."""
    components = {k: None if np.isnan(v) else float(v) for k, v in info.get("reward_components", {}).items()}
    row = {"prompt": info.get("prompt", ""), "completion": info["completion"],
           "finish_reason": info.get("finish_reason"), "reward_components": components, "reward": reward}  # fmt: skip
    if "turns" in info:
        row["turns"] = [dict(t) for t in info["turns"]]
        row["turn_rewards"] = [float(r) for r in info.get("turn_rewards", ())]
    if "reward_extras" in info:
        row["reward_extras"] = dict(info["reward_extras"])
    return row


@contextlib.contextmanager
def seeded_policy(agent: Any, seed: int, *, explore: bool = True) -> Iterator[None]:
    """Within the block, an SB3 agent's actions draw from streams that start from ``seed``, and training's
    go on after it as if it drew none: torch's, numpy's and Python's global streams (see
    :func:`~textgym.models.seeded_sampling`) and the agent's action space's own generator, which a DQN's
    random (epsilon-greedy) actions come from. ``explore=False`` also sets an epsilon-greedy agent's
    ``exploration_rate`` to 0 within the block: its actions are then its Q-network's, not the exploration
    schedule's, whatever point of training it is at."""
    space = getattr(agent, "action_space", None)
    space_state = None if space is None else space.np_random.bit_generator.state
    rate = getattr(agent, "exploration_rate", None)
    try:
        if space is not None:
            space.seed(seed)
        if not explore and rate is not None:
            agent.exploration_rate = 0.0
        with seeded_sampling(seed):
            yield
    finally:
        if space is not None:
            space.np_random.bit_generator.state = space_state
        if rate is not None:
            agent.exploration_rate = rate


def sb3_episodes(agent: Any, env: Any, seed: int) -> list[dict[str, Any]]:
    """One episode per sub-env of a ``TextGenVectorEnv`` (``autoreset_mode="Disabled"``), actions from an
    SB3-style ``agent.predict`` (sampled, not greedy; a DQN's without exploration): the sample tables of SB3
    runs."""
    rows: list[dict[str, Any]] = [{} for _ in range(env.num_envs)]
    returns = np.zeros(env.num_envs)  # every step's reward: a multi-turn env pays one per turn
    predict = Predictor(agent, env.num_envs)
    with seeded_policy(agent, seed, explore=False):  # the policy's own actions, not epsilon-greedy's
        obs, _ = env.reset(seed=seed)
        while env.active.any():
            active = env.active.copy()
            actions = predict(obs, env, deterministic=False)
            obs, rewards, terminated, truncated, infos = env.step(actions.astype(np.int64))
            returns += np.where(active, rewards, 0.0)
            predict.ended(terminated | truncated)
            for i in np.flatnonzero(terminated | truncated):
                rows[i] = sb3_row(_ended(infos, i), float(returns[i]))
    return rows


def load_sb3_run(run_dir: Path, env: Any) -> Any:
    """The SB3 agent of a finished run directory, on ``env`` (loaded as :func:`load_sb3_checkpoint` does)."""
    from textgym.agent_config import resolve_agent
    from textgym.config import load_config
    from textgym.rundir import CHECKPOINT

    config = load_config(Path(run_dir) / "config.toml")
    agent_class, policy, hyperparameters = resolve_agent(config["agent"])
    fresh = agent_class(policy, env, **{"seed": config["run"]["seed"], "verbose": 0, **hyperparameters})
    return load_sb3_checkpoint(fresh, agent_class, Path(run_dir) / CHECKPOINT, env)[0]


REPLAY_BUFFER = "replay_buffer.npz"
REPLAY_FIELDS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


def save_sb3_checkpoint(agent: Any, path: Path, state: dict[str, Any]) -> None:
    from textgym.atomic import atomic_build_dir

    def build(out: Path) -> None:
        agent.save(out / SB3_MODEL)
        buffer = getattr(agent, "replay_buffer", None)
        if buffer is not None:
            save_replay_buffer(buffer, out / REPLAY_BUFFER)
        (out / "state.json").write_text(json.dumps({**state, "num_timesteps": agent.num_timesteps}, indent=2))

    atomic_build_dir(path, build, replace=True)


def _replay_arrays(buffer: Any) -> dict[str, np.ndarray]:
    """A replay buffer's arrays by name (``observations/KEY`` for a dict observation space's)."""
    arrays = {}
    for field in REPLAY_FIELDS:
        value = getattr(buffer, field, None)  # next_observations is None under optimize_memory_usage
        if isinstance(value, dict):
            arrays.update({f"{field}/{key}": array for key, array in value.items()})
        elif value is not None:
            arrays[field] = value
    return arrays


def save_replay_buffer(buffer: Any, path: Path) -> None:
    """An off-policy agent's (DQN's) replay buffer as plain arrays, its filled rows only: SB3's own
    ``save_replay_buffer`` pickles it, and a checkpoint is loaded without unpickling anything."""
    filled = buffer.buffer_size if buffer.full else buffer.pos
    arrays = {name: array[:filled] for name, array in _replay_arrays(buffer).items()}
    with open(path, "wb") as f:
        np.savez(f, pos=np.int64(buffer.pos), full=np.bool_(buffer.full), **arrays)


def load_replay_buffer(buffer: Any, path: Path) -> None:
    """Fill a fresh replay buffer of the same size from :func:`save_replay_buffer`'s file."""
    import zipfile

    arrays = _replay_arrays(buffer)
    try:
        saved = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{path.name} is not a readable .npz file ({type(exc).__name__}: {exc})") from exc
    with saved:
        if set(saved.files) != {"pos", "full", *arrays}:
            raise ValueError(f"{path.name} holds {sorted(saved.files)}, not this agent's replay buffer")
        for name, array in arrays.items():
            rows = saved[name]
            if rows.shape[1:] != array.shape[1:] or len(rows) > len(array):
                raise ValueError(
                    f"{path.name}: {name} has shape {rows.shape}; this buffer's is {array.shape}"
                )
            array[: len(rows)] = rows
        buffer.pos, buffer.full = int(saved["pos"]), bool(saved["full"])


def load_sb3_checkpoint(fresh: Any, agent_class: Any, path: Path, env: Any) -> tuple[Any, dict[str, Any]]:
    """Load an SB3 checkpoint without unpickling anything: every object SB3 stored pickled (schedules, spaces,
    classes) is taken from ``fresh``, an agent built from the run's config, so a run directory received from
    someone else cannot run code. Tensors are SB3's ``weights_only`` loads."""
    import zipfile

    model = path / SB3_MODEL
    try:
        with zipfile.ZipFile(model) as archive:
            data = json.loads(archive.read("data"))
        pickled = [k for k, v in data.items() if isinstance(v, dict) and ":serialized:" in v]
        missing = [k for k in pickled if not hasattr(fresh, k)]
        if missing:
            raise ConfigError(
                f"checkpoint {model} stores pickled objects textgym does not rebuild: {missing}."
            )
        # where and how loudly it trains are the fresh agent's (a resume may change them): SB3 saves no
        # device, and its saved verbose and tensorboard_log would win over the config's
        agent = agent_class.load(
            model, env=env, device=fresh.device, custom_objects={k: getattr(fresh, k) for k in pickled},
            verbose=fresh.verbose, tensorboard_log=fresh.tensorboard_log,
        )  # fmt: skip
        if getattr(agent, "replay_buffer", None) is not None and (path / REPLAY_BUFFER).exists():
            load_replay_buffer(agent.replay_buffer, path / REPLAY_BUFFER)
        state = json.loads((path / "state.json").read_text())
    except ConfigError:
        raise
    except (OSError, KeyError, ValueError, RuntimeError, zipfile.BadZipFile) as exc:
        raise ConfigError(
            f"checkpoint {str(path)!r} is corrupt or incomplete: {type(exc).__name__}: {exc}"
        ) from exc
    return agent, state
