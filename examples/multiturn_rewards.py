"""Reward functions for the multi-turn examples: they read the whole conversation through `Sample.turns`."""


def used_tool(samples):
    """1.0 when the agent called the tool in an earlier turn (a `tool` reply exists), else 0.0."""
    return [float(any(turn.role == "tool" for turn in s.turns)) for s in samples]


def turns_taken(samples):
    """How many turns the agent took (a logged metric for the games)."""
    return [float(sum(turn.role == "assistant" for turn in s.turns)) for s in samples]
