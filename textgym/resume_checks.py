"""What a resume of a run may change, checked before it starts: a resume continues the run as it was trained
(its optimizer, KL controller, seeds and env come from the checkpoint and ``config.toml``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from textgym.errors import ConfigError
from textgym.rundir import RunDir

__all__ = ["MACHINE_SETTINGS", "RESUME_SETTINGS", "check_checkpoint_config", "check_resume_changes"]


# hyperparameters that say where and how loudly a run trains, not what it learns: a resume may differ in them
MACHINE_SETTINGS = ("device", "verbose", "tensorboard_log")


def check_checkpoint_config(rd: RunDir, hyperparameters: dict[str, Any]) -> None:
    """The checkpoint was trained with the hyperparameters the run's config.toml gives now. A resume loads
    the optimizer (its learning rate) and the counters from the checkpoint and the rest from config.toml: a
    value edited there would half apply (a new n_epochs, the old learning rate), and state.json would record
    one that was never used."""
    from textgym.evaluation import jsonable

    state_file = rd.checkpoint / "state.json"
    try:
        trained = json.loads(state_file.read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError):
        return  # an incomplete checkpoint: loading it says what is wrong
    changed = [
        f"{'run' if key == 'seed' else 'agent'}.{key}: {trained[key]!r} -> {value!r}"  # the seed is run.seed
        for key, value in hyperparameters.items()
        if key in trained and key not in MACHINE_SETTINGS and jsonable(value) != jsonable(trained[key])
    ]
    if changed:
        # a LoRA checkpoint's policy/ holds the adapter alone, which is not a model to start from
        start = (
            f"merge its adapter, {rd.checkpoint / 'policy'}, into its base model (peft's merge_and_unload) and save "
            f"it with the tokenizer, to start from its weights"
            if trained.get("lora") is not None
            else f"agent.policy = '{rd.checkpoint / 'policy'}' starts from its weights"
        )
        raise ConfigError(
            f"{rd.path / 'config.toml'} no longer says what {rd.checkpoint} was trained with ({'; '.join(changed)}): "
            f"a resume continues the run as it was trained. Put those values back, or start a new run to change "
            f"them ({start})."
        )


# what a resume may change: how long the run goes on and what it writes; not what it trains, or how
RESUME_SETTINGS = ("run.total_timesteps", "run.checkpoint_every", "run.sample_prompts", "run.plugins",
                   "run.report_to")  # fmt: skip


def check_resume_changes(
    run_dir: Path, saved: dict[str, Any], config: dict[str, Any], agent_name: str | None
) -> None:
    if agent_name and agent_name != saved["agent"]["name"]:
        raise ConfigError(
            f"--agent {agent_name}: {run_dir} trains {saved['agent']['name']!r}, and a resume continues it; start "
            f"a new run for another agent, in a directory of its own (textgym train {run_dir / 'config.toml'} "
            f"--agent {agent_name} --set run.output_dir='{run_dir}-{agent_name}')."
        )
    changed = [
        key
        for key in _differences(saved, config)
        if key not in RESUME_SETTINGS
        and not (key.startswith("agent.") and key.rsplit(".", 1)[-1] in MACHINE_SETTINGS)  # where it trains
    ]
    if changed:
        raise ConfigError(
            f"--set {', '.join(changed)} on --resume: a resume continues {run_dir} as it was trained (its "
            f"optimizer, KL controller, seeds and env come from the checkpoint and config.toml), so only "
            f"{', '.join(RESUME_SETTINGS)} and the agent's {', '.join(MACHINE_SETTINGS)} may change. Start a new "
            f"run to change the others."
        )


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two configs."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return [prefix] if a != b else []
    return [
        key
        for name in dict.fromkeys([*a, *b])
        for key in _differences(a.get(name), b.get(name), f"{prefix}.{name}" if prefix else str(name))
    ]
