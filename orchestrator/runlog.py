"""The run directory: resolved config, metrics.jsonl, transcripts.jsonl, checkpoints, plots.

    RUN_DIR/config.yaml          the resolved config (relative paths made absolute)
    RUN_DIR/metrics.jsonl        one line per step
    RUN_DIR/transcripts.jsonl    a sample of whole episodes per step
    RUN_DIR/checkpoints/step-000010/{agents/NAME/, coordinator.json}
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from protocols.config import LoggingConfig, RunConfig

CHECKPOINT_DONE = "coordinator.json"  # written last: a checkpoint without it is incomplete


def make_run_dir(template: str, name: str) -> Path:
    path = Path(template.format(name=name, time=time.strftime("%Y%m%d-%H%M%S")))
    path.mkdir(parents=True, exist_ok=True)
    return path


class RunLog:
    def __init__(self, run_dir: str | Path, logging: LoggingConfig | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sinks = _sinks(logging or LoggingConfig(), self.dir)

    # ------------------------------------------------------------------------------------ records
    def write_config(self, config: RunConfig) -> None:
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        for sink in self.sinks:
            sink(metrics)

    def log_transcripts(self, step: int, transcripts: list[dict[str, Any]]) -> None:
        with open(self.dir / "transcripts.jsonl", "a") as f:
            for t in transcripts:
                f.write(json.dumps({"step": step, **t}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (they are replayed after a resume)."""
        for name in ("metrics.jsonl", "transcripts.jsonl"):
            path = self.dir / name
            if path.exists():
                kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
                path.write_text("".join(line + "\n" for line in kept))

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / "metrics.jsonl")

    # -------------------------------------------------------------------------------- checkpoints
    def checkpoint_dir(self) -> Path:
        return self.dir / "checkpoints"

    def staging_path(self, step: int) -> Path:
        """A fresh temporary directory to write the checkpoint of `step` into."""
        path = self.checkpoint_dir() / f".tmp-step-{step:06d}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def commit_checkpoint(self, staging: Path, step: int, state: dict[str, Any], keep: int) -> Path:
        """Write the coordinator state (with a checksum of every file) last, rename the directory into
        place, keep the newest `keep`."""
        manifest = {str(p.relative_to(staging)): _sha256(p) for p in sorted(staging.rglob("*")) if p.is_file()}
        (staging / CHECKPOINT_DONE).write_text(json.dumps({**state, "manifest": manifest}))
        final = self.checkpoint_dir() / f"step-{step:06d}"
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        for old in self.checkpoints()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        root = self.checkpoint_dir()
        if not root.exists():
            return []
        return sorted(p for p in root.glob("step-*") if (p / CHECKPOINT_DONE).exists())

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` must not be loaded (missing, truncated or altered file), or None."""
    try:
        manifest = json.loads((path / CHECKPOINT_DONE).read_text())["manifest"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{CHECKPOINT_DONE} unreadable ({type(exc).__name__})"
    for name, digest in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if _sha256(file) != digest:
            return f"{name} does not match its checksum"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(run_dir: str | Path) -> list[Path]:
    """PNG curves of the shared reward and each agent's loss; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl rows to plot; is this a run directory?")
    written = []
    for key_prefix, title, name in (("reward/", "reward", "reward.png"), ("loss/", "loss per agent", "loss.png")):
        keys = sorted({k for r in rows for k in r if k.startswith(key_prefix) and k != "reward/std"})
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=key.removeprefix(key_prefix))
        ax.set_xlabel("step")
        ax.set_title(title)
        if keys:
            ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / name, dpi=100)
        plt.close(fig)
        written.append(run_dir / name)
    return written


def _sinks(logging: LoggingConfig, run_dir: Path) -> list:
    sinks = []
    if logging.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise RuntimeError("logging.tensorboard needs TensorBoard: pip install 'marsi[tensorboard]'") from None
        writer = SummaryWriter(str(run_dir / "tensorboard"))

        def tensorboard(m):
            for k, v in m.items():
                if isinstance(v, (int, float)) and k != "step":
                    writer.add_scalar(k, v, m["step"])
            writer.flush()

        sinks.append(tensorboard)
    if logging.wandb_project:
        try:
            import wandb
        except ImportError:
            raise RuntimeError("logging.wandb_project needs wandb: pip install 'marsi[wandb]'") from None
        wandb_run = wandb.init(project=logging.wandb_project, dir=str(run_dir))
        sinks.append(lambda m: wandb_run.log({k: v for k, v in m.items() if isinstance(v, (int, float))},
                                             step=m["step"]))
    return sinks
