"""The run directory: resolved config, metrics.jsonl, transcripts.jsonl, checkpoints (plots: orchestrator/plot.py).

    RUN_DIR/config.yaml          the resolved config (relative paths made absolute)
    RUN_DIR/metrics.jsonl        one line per step
    RUN_DIR/transcripts.jsonl    a sample of whole episodes per step
    RUN_DIR/checkpoints/step-000010/{agents/NAME/, coordinator.json}
    RUN_DIR/.lock                held (flock) by the one live process writing the run

A run directory belongs to one run: a new run refuses a directory that holds one, and a lock keeps a
second live process out. Files are never rewritten in place: a cut-back file is written beside the
old one and renamed over it. `coordinator.json` is written last and carries a checksum of every other
file of its checkpoint and of itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import yaml

from protocols.config import LoggingConfig, RunConfig
from protocols.errors import UserError

CHECKPOINT_DONE = "coordinator.json"  # written last: a checkpoint without it is incomplete
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
_STATE_KEYS = ("step", "episodes", "data", "baselines", "manifest")


class RunDirError(UserError, RuntimeError):
    """The run directory cannot be used as asked (holds another run, in use, a corrupt record)."""


def make_run_dir(template: str, name: str) -> Path:
    """A new directory from `template` ({name}, {time}); `-2`, `-3`, ... is appended if it exists, so two
    runs started in the same second never share one."""
    base = template.format(name=name, time=time.strftime("%Y%m%d-%H%M%S"))
    for n in range(1, 10_000):
        path = Path(base if n == 1 else f"{base}-{n}")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise RunDirError(f"{base}: 10,000 run directories of this name exist; set train.run_dir or --run-dir")


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))


class RunLog:
    """Reads and writes one run directory. `claim()` makes this process its writer."""

    def __init__(self, run_dir: str | Path, logging: LoggingConfig | None = None):
        self.dir = Path(run_dir)
        self.logging = logging or LoggingConfig()
        self.sinks: list = []
        self._lock = None

    # ------------------------------------------------------------------------------------ claim
    def claim(self, *, resume: bool) -> None:
        """Become the one writer of this directory: a new run needs a directory that holds no run, a
        resumed one a directory that does; either way no other live process may hold it."""
        if resume and not holds_run(self.dir):
            raise RunDirError(f"{self.dir}: holds no run to resume (no config.yaml); start one with marsi run")
        if not resume and holds_run(self.dir):
            raise RunDirError(f"{self.dir}: already holds a run; continue it with: marsi resume {self.dir} "
                              "(or give a new --run-dir)")
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.dir / ".lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise RunDirError(f"{self.dir}: in use by {holder}; wait for it to end or stop it first") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"marsi pid {os.getpid()}")
        lock.flush()
        self._lock = lock
        self.sinks = _sinks(self.logging, self.dir)

    def release(self) -> None:
        """Give up the directory; one that still holds nothing (a run that failed to start) is removed."""
        if self._lock is None:
            return
        if self.dir.is_dir() and {p.name for p in self.dir.iterdir()} <= {".lock"}:
            (self.dir / ".lock").unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.dir.rmdir()
        self._lock.close()  # closing the file drops the flock; a killed process drops it too
        self._lock = None

    def disk_full(self, exc: BaseException) -> bool:
        """Whether a failed write looks like a full or read-only disk: an OSError saying so anywhere in the
        chain (a trainer in another process reports it as text), or almost no space left on this disk."""
        chain, seen = [], exc
        while seen is not None:
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        if any(isinstance(e, OSError) and e.errno in _DISK_ERRNOS for e in chain):
            return True
        if any(text in str(e) for e in chain for text in ("No space left", "Read-only file system", "quota")):
            return True
        try:
            usage = shutil.disk_usage(self.dir)
        except OSError:
            return False
        return usage.free < min(64 * 2**20, usage.total // 100)

    def disk_problem(self, exc: BaseException) -> str:
        """One line for a write that failed (full or read-only disk): which disk, and what is safe."""
        try:
            usage = shutil.disk_usage(self.dir)
            space = f"{usage.free / 2**20:.0f} MB free of {usage.total / 2**20:.0f} MB"
        except OSError:
            space = "free space unknown"
        last = self.latest_checkpoint()
        keep = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
        return (f"writing to {self.dir} failed ({' '.join(str(exc).split())}; disk: {space}); {keep}; free space "
                f"or make the disk writable, then: marsi resume {self.dir}")

    def steps_done(self) -> int | None:
        """The step of the newest intact checkpoint, or None."""
        for path in reversed(self.checkpoints()):
            if checkpoint_problem(path) is None:
                return read_checkpoint_state(path)["step"]
        return None

    # ------------------------------------------------------------------------------------ records
    def write_config(self, config: RunConfig) -> None:
        (self.dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))

    def snapshot_sources(self, specs: list[str | None]) -> None:
        """Copy the source files of the environment and data factory beside config.yaml (RUN_DIR/source/), so
        the run can be read and rerun after the code changes; installed packages are left out."""
        for spec in specs:
            source = _source_file(spec) if spec else None
            if source is not None:
                (self.dir / "source").mkdir(exist_ok=True)
                shutil.copy2(source, self.dir / "source" / source.name)

    def discard_unstarted(self) -> bool:
        """Remove what marsi wrote for a run that logged no step (it failed before training); True if removed."""
        if (self.dir / "metrics.jsonl").exists() and self.metrics():
            return False
        for name in ("config.yaml", "metrics.jsonl", "transcripts.jsonl", ".lock"):
            (self.dir / name).unlink(missing_ok=True)
        for name in ("checkpoints", "source", "tensorboard"):
            shutil.rmtree(self.dir / name, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.dir.rmdir()  # only if nothing else is in it
        return True

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        for sink in self.sinks:
            sink(metrics)

    def log_eval(self, row: dict[str, Any]) -> None:
        """Append one `marsi eval` result to eval.jsonl (only `marsi eval` writes it, so a live run is left alone)."""
        with open(self.dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def log_transcripts(self, step: int, transcripts: list[dict[str, Any]]) -> None:
        with open(self.dir / "transcripts.jsonl", "a") as f:
            for t in transcripts:
                f.write(json.dumps({"step": step, **t}) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (they are replayed after a resume): each file is streamed
        into a new one beside it, which then replaces it, so a crash at any moment leaves one whole file."""
        for name in ("metrics.jsonl", "transcripts.jsonl"):
            path = self.dir / name
            if not path.exists():
                continue
            tmp = path.with_name(f".{name}.tmp")
            with open(tmp, "w") as out:
                for line, row in _jsonl_lines(path):
                    if row["step"] <= step:
                        out.write(line)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)

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
        """Write the coordinator state (with a checksum of every file and of itself) last, rename the
        directory into place, keep the newest `keep`."""
        manifest = {str(p.relative_to(staging)): _sha256(p) for p in sorted(staging.rglob("*")) if p.is_file()}
        record = {**state, "manifest": manifest}
        (staging / CHECKPOINT_DONE).write_text(json.dumps({**record, "sha256": _digest(record)}))
        final = self.checkpoint_dir() / f"step-{step:06d}"
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        for old in self.checkpoints()[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first (by step number, not by name)."""
        root = self.checkpoint_dir()
        if not root.exists():
            return []
        found = [p for p in root.glob("step-*") if p.name[5:].isdigit() and (p / CHECKPOINT_DONE).exists()]
        return sorted(found, key=lambda p: int(p.name[5:]))

    def latest_checkpoint(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    """The coordinator state of the checkpoint at `path`; ValueError unless it is whole and unaltered."""
    try:
        raw = json.loads((path / CHECKPOINT_DONE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{CHECKPOINT_DONE} unreadable ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or "sha256" not in raw:
        raise ValueError(f"{CHECKPOINT_DONE} has no checksum of itself")
    digest = raw.pop("sha256")
    if _digest(raw) != digest:
        raise ValueError(f"{CHECKPOINT_DONE} does not match its checksum")
    missing = [k for k in _STATE_KEYS if k not in raw]
    if missing:
        raise ValueError(f"{CHECKPOINT_DONE} lacks {', '.join(missing)}")
    return raw


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at `path` must not be loaded (missing, truncated or altered file), or None."""
    try:
        manifest = read_checkpoint_state(path)["manifest"]
    except ValueError as exc:
        return str(exc)
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


def _source_file(spec: str) -> Path | None:
    """The file an import spec's object is defined in, unless it belongs to an installed package."""
    import inspect

    from protocols.imports import import_object

    try:
        path = Path(inspect.getsourcefile(import_object(spec)) or "")
    except (TypeError, OSError, ImportError):
        return None
    installed = ("site-packages", "dist-packages")
    if not path.is_file() or any(part in installed for part in path.parts) or path.is_relative_to(sys.base_prefix):
        return None
    return path


def _digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _jsonl_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, row) of a JSON-lines file. A torn final line (a crash or full disk mid-append) is dropped
    and reported; a corrupt line elsewhere is a one-line error naming the file and line."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.endswith("\n"):
                print(f"marsi: {path}:{number}: dropping a torn last line ({len(line)} characters, cut off "
                      "mid-write)", file=sys.stderr, flush=True)
                return
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise RunDirError(f"{path}:{number}: not a JSON record with a step; repair or delete that line")
            yield line, row


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [row for _, row in _jsonl_lines(path)]


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
