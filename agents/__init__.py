"""textgym's agents, one per file, registered through ``register_agents``.

Registered as ``"module:attribute"`` strings, imported on first use, so ``import textgym`` stays light.
"""

from collections.abc import Callable

from textgym.hookspecs import hookimpl


@hookimpl
def register_agents(register: Callable[..., None]) -> None:
    # PPO with a causal-LM policy and a value head, on TextGenVectorEnv.
    register("lmppo", "textgym.agents.ppo:LMPPO")
    # Critic-free: group-relative advantages over num_generations completions per prompt.
    register("grpo", "textgym.agents.grpo:GRPO")
    # Critic-free: REINFORCE with a leave-one-out baseline over each prompt's completions.
    register("rloo", "textgym.agents.rloo:RLOO")
    # Stable-Baselines3's PPO with an MLP policy, for the small-vocabulary envs (through textgym.sb3).
    register("sb3-ppo", "stable_baselines3:PPO")
