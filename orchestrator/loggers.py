"""The run's loggers besides metrics.jsonl (TensorBoard, Weights & Biases), opened by `RunLog.claim`, and the check
that their packages are installed, made before the run directory is."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from protocols.config import LoggingConfig
from protocols.errors import UserError


class MissingExtra(UserError, ImportError):
    """The config asks for a logger whose package is not installed."""


def missing_extra(logging: LoggingConfig) -> None:
    """Raise MissingExtra, naming the key and the install command, when a logger the config asks for is not
    installed; checked before the run directory is made."""
    import importlib.util

    wanted = []
    if logging.tensorboard:
        wanted.append(("logging.tensorboard", "tensorboard", "TensorBoard", "set logging.tensorboard: false"))
    if logging.wandb_project:
        wanted.append(("logging.wandb_project", "wandb", "Weights & Biases", "remove logging.wandb_project"))
    for key, package, name, instead in wanted:
        if importlib.util.find_spec(package) is None:
            raise MissingExtra(f"{key} needs {name}, which is not installed; install it with: pip install {package} "
                               f"(or {instead})")



# ------------------------------------------------------------------------------------------ loggers
def scalars(metrics: dict[str, Any]) -> dict[str, float | int]:
    """The scalar keys of a metrics row (bools as 0/1), `step` left out: what TensorBoard and W&B receive."""
    return {k: int(v) if isinstance(v, bool) else v for k, v in metrics.items()
            if k != "step" and isinstance(v, (int, float))}


def episode_rows(step: int, transcripts: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per action of the episodes logged at `step`, in `EPISODE_COLUMNS` order."""
    return [[step, t["episode"], i, a["agent"], a["role"], a["prompt"], a["completion"], turn["reward"], t["reward"],
             a["advantage"], a["policy_version"]]
            for t in transcripts for i, turn in enumerate(t["turns"]) for a in turn["actions"]]


EPISODE_COLUMNS = ["step", "episode", "turn", "agent", "role", "prompt", "completion", "reward", "episode_reward",
                   "advantage", "policy_version"]
"""The columns of W&B's episode tables: one row per action; `reward` is its turn's, `episode_reward` the episode's."""


class Logger:
    """A metric sink besides metrics.jsonl: every metrics row, the episodes the run saves, closed at the end."""

    def log(self, metrics: dict[str, Any]) -> None:
        raise NotImplementedError

    def log_episodes(self, step: int, transcripts: list[dict[str, Any]], *, evaluation: bool) -> None:
        """Episodes written to transcripts.jsonl (or eval_transcripts.jsonl when `evaluation`); none by default."""

    def truncate_after(self, step: int) -> None:
        """A resumed run replays the steps after `step`; what was logged for them may be dropped."""

    def close(self) -> None:
        pass


class TensorBoardLogger(Logger):
    """Every scalar of every metrics row at its step, under RUN_DIR/tensorboard (evaluation rows share their step
    with the training row: their keys differ). A resume purges the replayed steps' events (`purge_step`)."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / "tensorboard"
        self.writer = self._open(None)

    def _open(self, purge_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(str(self.dir), purge_step=purge_step)

    def log(self, metrics: dict[str, Any]) -> None:
        for key, value in scalars(metrics).items():
            self.writer.add_scalar(key, value, metrics["step"])
        self.writer.flush()

    def truncate_after(self, step: int) -> None:
        self.writer.close()
        self.writer = self._open(step + 1)

    def close(self) -> None:
        self.writer.close()


class WandbLogger(Logger):
    """Every scalar of every metrics row, with `step` as the x-axis of every chart (W&B's own `_step` counts
    log calls: an evaluation row and a resumed run's replayed steps share a step with rows before them); the
    saved episodes as incremental tables `episodes` and `eval/episodes`, one row per action. The W&B run id
    is kept in RUN_DIR/wandb/run-id, so `marsi resume` continues the same W&B run. `WANDB_MODE=offline`
    writes it under RUN_DIR/wandb/ only (`wandb sync` uploads it later)."""

    def __init__(self, project: str, run_dir: Path):
        import wandb

        self.wandb = wandb
        (run_dir / "wandb").mkdir(exist_ok=True)
        id_file = run_dir / "wandb" / "run-id"
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(4))  # W&B run ids: 8 characters of [0-9a-z]
        self.run = wandb.init(project=project, dir=str(run_dir), name=run_dir.resolve().name,
                              id=id_file.read_text().strip(), resume="allow")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.tables: dict[bool, Any] = {}

    def log(self, metrics: dict[str, Any]) -> None:
        self.run.log({"step": metrics["step"], **scalars(metrics)})

    def log_episodes(self, step: int, transcripts: list[dict[str, Any]], *, evaluation: bool) -> None:
        table = self.tables.get(evaluation)
        if table is None:
            table = self.tables[evaluation] = self.wandb.Table(columns=EPISODE_COLUMNS, log_mode="INCREMENTAL")
        for row in episode_rows(step, transcripts):
            table.add_data(*row)
        self.run.log({"step": step, "eval/episodes" if evaluation else "episodes": table})

    def close(self) -> None:
        self.run.finish()


def open_loggers(logging: LoggingConfig, run_dir: Path) -> list[Logger]:
    """The loggers the config asks for (`missing_extra` has checked that their packages are installed)."""
    loggers: list[Logger] = []
    try:
        if logging.tensorboard:
            loggers.append(TensorBoardLogger(run_dir))
        if logging.wandb_project:
            loggers.append(WandbLogger(logging.wandb_project, run_dir))
    except BaseException:
        for logger in loggers:
            logger.close()
        raise
    return loggers
