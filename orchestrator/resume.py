"""What a resume may change: the checks, before anything in the run directory is touched, that a resumed run's
config can continue its checkpoints."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from agent_trainer import storage
from orchestrator.checkpoints import no_checkpoint
from orchestrator.runlog import RunLog
from protocols.config import RunConfig, critic_settings
from protocols.errors import UserError
from protocols.messages import Location


class ResumeError(UserError, ValueError):
    """Overrides that cannot apply to a run's checkpoints; nothing in the run directory was changed."""


def check_resume(config: RunConfig, stored: RunConfig, log: RunLog) -> None:
    """Refuse, before anything is touched, a resume whose config cannot continue the run's checkpoints."""
    done = log.steps_done()
    if done is None:
        raise FileNotFoundError(no_checkpoint(log))
    if set(config.agents) != set(stored.agents):
        raise ResumeError(f"{log.dir}: a resumed run keeps its agents ({', '.join(stored.agents)}); the overrides make "
                          f"them {', '.join(config.agents)}; start a new run for other agents")
    kept, given = _critic_label(stored), _critic_label(config)
    if given != kept:
        raise ResumeError(f"{log.dir}: a resumed run keeps its critic ({kept}); the overrides make it {given}; start a "
                          "new run for another critic")
    if config.train.steps < done:
        raise ResumeError(f"train.steps={config.train.steps} is below the {done} steps {log.dir} has done; "
                          f"give train.steps >= {done}")
    if config.train.storage != stored.train.storage:
        given = f"train.storage={config.train.storage!r}" if config.train.storage else "train.storage unset"
        kept = repr(stored.train.storage) if stored.train.storage else f"the run directory, {log.dir / 'checkpoints'}"
        raise ResumeError(f"{given}: a resumed run keeps its checkpoint storage ({kept}); copy the checkpoints and "
                          "start a new run to move them")
    from agent_trainer.models import architecture_mismatch

    checkpoint = log.latest_checkpoint()
    for name, agent in config.agents.items():
        if agent.model == stored.agents[name].model:
            continue
        with _saved_model_config(checkpoint / "agents" / name / "model") as saved:
            problem = architecture_mismatch(agent.model, saved) if saved is not None else None
        if problem:
            raise ResumeError(f"agents.{name}.model={agent.model!r}: {problem}, so the checkpoint's weights "
                              "cannot load into it; resume with the run's model")


def _critic_label(config: RunConfig) -> str:
    critic = critic_settings(config)
    return f"critic.kind {critic.kind}, critic.model {critic.model}" if critic else "none"


@contextlib.contextmanager
def _saved_model_config(saved: Location):
    """A local directory holding the config.json of a checkpoint's saved model (fetched from the store into
    a temporary directory), or None when the checkpoint holds no weights (a frozen agent's)."""
    with tempfile.TemporaryDirectory(prefix="marsi-config-") as tmp:
        try:
            (Path(tmp) / "config.json").write_bytes(storage.read_bytes(saved / "config.json"))
        except OSError:
            yield None
            return
        yield tmp
