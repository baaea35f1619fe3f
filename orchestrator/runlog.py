"""The run directory: resolved config, metrics.jsonl, transcripts.jsonl, checkpoints (plots: orchestrator/plot.py).

    RUN_DIR/config.yaml          the resolved config (relative paths made absolute)
    RUN_DIR/metrics.jsonl        one line per step
    RUN_DIR/transcripts.jsonl    a sample of whole episodes per step (train.transcripts_per_step)
    RUN_DIR/eval_transcripts.jsonl   the first episodes of each evaluation (eval.transcripts)
    RUN_DIR/source/              the environment's and data factory's source files
    RUN_DIR/tensorboard/, wandb/ the loggers' files (logging.tensorboard, logging.wandb_project: orchestrator/loggers.py)
    RUN_DIR/checkpoints/step-000010/{agents/NAME/, coordinator.json}
    RUN_DIR/.lock                held (flock) by the one live process writing the run

A run directory belongs to one run: a new run refuses a directory that holds one, and a lock keeps a
second live process out; with `train.storage`, the run's lease in the store (`orchestrator/lease.py`) keeps out a
second writer on any machine. Files are never rewritten in place: a cut-back file is written beside the
old one and renamed over it. `coordinator.json` is written last and carries a checksum (and size) of
every other file of its checkpoint, as the trainers that wrote them reported, and of itself.

With `train.storage` set, checkpoints live at `STORAGE/RUN_NAME/checkpoints/step-N/` instead, with the
same layout, each also carrying the run directory's records (`orchestrator/runstore.py`), and
`RUN_DIR/store.json` records that place (so a renamed run directory finds it). Either way a checkpoint
is a `Location` in the checkpoint store (agent_trainer/storage.py; `RUN_DIR/checkpoints` is a `file://`
location), written, committed, listed, checked and pruned the same way: trainers write straight into
`step-N/`, and the checkpoint counts once `coordinator.json` is there (put in place whole, last).
Rewriting or pruning a checkpoint deletes its `coordinator.json` first, and uncommitted directories
left by a crash (`step-N/` without it; `.tmp-step-N/` of earlier marsi versions) are removed at the
next commit. A checkpoint's names, its record and the checks before a load: `orchestrator/checkpoint_files.py`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterator

import yaml

from agent_trainer import storage
from agent_trainer.storage import StorageError
from orchestrator.checkpoint_files import (
    CHECKPOINT_DONE, EVAL_TRANSCRIPTS, TRANSCRIPTS, CheckpointName, checkpoint_problem, complete_checkpoints,
    read_checkpoint_state, record_digest,
)
from orchestrator.lease import Lease
from orchestrator.loggers import Logger, missing_extra, open_loggers
from protocols.config import LoggingConfig, RunConfig, stored_form
from protocols.errors import UserError
from protocols.messages import DEFAULT_STORE_DEADLINE_S, Location

_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}
STORE_RECORD = "store.json"  # with train.storage: the run's place in the store (STORAGE/RUN_NAME)


class RunDirError(UserError, RuntimeError):
    """The run directory cannot be used as asked (holds another run, in use, a corrupt record)."""


def make_run_dir(template: str, name: str) -> Path:
    """A new directory from `template` ({name}, {time}); `-2`, `-3`, ... is appended if it exists, so two
    runs started in the same second never share one (and the run says where it went)."""
    base = template.format(name=name, time=time.strftime("%Y%m%d-%H%M%S"))
    for n in range(1, 10_000):
        path = Path(base if n == 1 else f"{base}-{n}")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        if n > 1:
            print(f"marsi: {base} exists; this run writes to {path}", file=sys.stderr, flush=True)
        return path
    raise RunDirError(f"{base}: 10,000 run directories of this name exist; set train.run_dir or --run-dir")


def lock_dir(run_dir: Path):
    """Hold the run directory's lock (`RUN_DIR/.lock`, an flock that a killed process drops too): the open file, to
    close to release it; RunDirError naming the holder when another live process has it."""
    lock = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise RunDirError(f"{run_dir}: in use by {holder}; wait for it to end or stop it first") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"marsi pid {os.getpid()}")
    lock.flush()
    return lock


def holds_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))


class Recorded:
    """`RunLog`'s default deadline: the one the run's config.yaml records."""


RECORDED = Recorded()


class RunLog:
    """Reads and writes one run directory. `claim()` makes this process its writer."""

    def __init__(self, run_dir: str | Path, logging: LoggingConfig | None = None, storage: str | None = None,
                 deadline_s: float | None | Recorded = RECORDED):
        """`storage`: the run's `train.storage`; None: as its config.yaml records (none: the run directory).
        `deadline_s`: its `train.storage_timeout_s`, which every location of the store this log hands out carries;
        by default as its config.yaml records."""
        self.dir = Path(run_dir)
        self.logging = logging or LoggingConfig()
        recorded = _recorded_train(self.dir) if storage is None or isinstance(deadline_s, Recorded) else {}
        self.storage = storage if storage is not None else _recorded_storage(recorded)
        self.deadline_s = _recorded_deadline(recorded) if isinstance(deadline_s, Recorded) else deadline_s
        self._place = recorded_place(self.dir, self.deadline_s) if self.storage is not None else None
        self.loggers: list[Logger] = []  # TensorBoard, W&B: opened by claim()
        self.lease: Lease | None = None  # with train.storage: this process's lease of the run's place, from claim()
        self._lock = None
        self._full: set[str] = set()  # transcript files that reached train.transcripts_max_mb
        self._unreachable = False  # a call to the store timed out at claim: no cleanup there
        self._made_root = False  # train.storage did not exist before this run made it (removed again if left empty)

    # ------------------------------------------------------------------------------------ claim
    def claim(self, *, resume: bool, take_over: bool = False) -> None:
        """Become the one writer of this directory: a new run needs a directory that holds no run, a
        resumed one a directory that does; either way no other live process may hold it, and with train.storage
        no other marsi the run's lease (`take_over`: take over a stale one)."""
        if resume and not holds_run(self.dir):
            raise RunDirError(f"{self.dir}: holds no run to resume (no config.yaml); start one with marsi run")
        if not resume and holds_run(self.dir):
            raise RunDirError(f"{self.dir}: already holds a run; continue it with: marsi resume {self.dir} "
                              "(or give a new --run-dir)")
        missing_extra(self.logging)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_dir(self.dir)
        try:
            self._claim_storage(resume, take_over)
            self.loggers = open_loggers(self.logging, self.dir)
        except BaseException:
            self.release()
            raise

    def _claim_storage(self, resume: bool, take_over: bool) -> None:
        """Take the run's lease (train.storage); a new run's place in the store must hold no other run's checkpoints
        (in the run directory, which holds no run, it holds none); it is made now, so an unreachable store fails
        before any trainer starts."""
        root = self.checkpoint_dir()
        try:
            self._made_root = self.storage is not None and not resume and not storage.exists(self._storage_root())
            if self.storage is not None:
                lease = Lease(root.parent)
                lease.take(take_over=take_over)
                self.lease = lease
            if not resume and self.checkpoints():
                raise RunDirError(f"train.storage: {root} already holds checkpoints of a run named {self.dir.resolve().name}; "
                                  f"continue that run with: marsi resume {root.parent}; or give a new --run-dir (its name "
                                  "names the run's place in storage) or another train.storage")
            storage.make_dirs(root)
        except storage.StorageTimeout:
            self._unreachable = True
            raise
        except OSError as exc:
            store = f"train.storage {self.storage}" if self.storage else "the run directory"
            raise StorageError(f"{store}: cannot use {root} ({' '.join(str(exc).split())}); "
                               "check the URI, that it exists and is writable, and for object stores the credentials") from None
        if not resume and self.storage is not None:
            self._place = root.parent
            (self.dir / STORE_RECORD).write_text(json.dumps({"place": str(self._place)}) + "\n")

    def owns_place(self) -> bool:
        """Whether this process may change the run's place in the store: it holds the run's lease (train.storage),
        or the run has its checkpoints in its run directory, which its lock keeps."""
        return self.storage is None or (self.lease is not None and self.lease.held)

    def _confirm_lease(self) -> None:
        """Before anything of a checkpoint is written or committed: LeaseLost unless this process holds the lease."""
        if self.lease is not None:
            self.lease.confirm()

    def _remove_empty_place(self) -> None:
        """Remove the run's place in the store (the run directory, or STORAGE/RUN_NAME), made at claim, if it
        holds no file; and train.storage itself if this run made it and it holds no file either."""
        if self._unreachable:
            return  # each call would wait train.storage_timeout_s again
        place = self.checkpoint_dir().parent
        with contextlib.suppress(OSError, StorageError):
            if not storage.file_sizes(place):
                storage.delete(place)
            root = self._storage_root() if self.storage is not None else None
            if self._made_root and not storage.file_sizes(root):  # an object store's prefix made for this run only
                storage.delete(root)

    def release(self) -> None:
        """Give up the directory; one that still holds nothing (a run that failed to start) is removed."""
        if self._lock is None:
            return
        self._close_loggers()
        owned = self._release_lease()
        if self.dir.is_dir() and {p.name for p in self.dir.iterdir()} <= {".lock", "checkpoints", STORE_RECORD}:
            (self.dir / ".lock").unlink(missing_ok=True)
            (self.dir / STORE_RECORD).unlink(missing_ok=True)
            if owned:
                self._remove_empty_place()
            with contextlib.suppress(OSError):
                self.dir.rmdir()
        self._lock.close()  # closing the file drops the flock; a killed process drops it too
        self._lock = None

    def _release_lease(self) -> bool:
        """Give up the run's lease (deleted from the store, so that the place may be empty); whether this process
        owned the place until now."""
        owned = self.owns_place()
        if self.lease is not None:
            with contextlib.suppress(OSError, StorageError):
                self.lease.release()
        return owned

    def _close_loggers(self) -> None:
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()

    def _disk(self, checkpoint: bool) -> tuple[str, Path | None]:
        """What a failed write went to, and its path on this machine's disk (None: an object store): the run
        directory, or (`checkpoint`) the checkpoint store."""
        if not checkpoint or self.storage is None:
            return str(self.dir), self.dir
        root = self.checkpoint_dir()
        try:
            local = storage.on_disk(root)
        except (OSError, StorageError):
            local = None
        while local is not None and not local.exists() and local != local.parent:
            local = local.parent  # the nearest directory that exists: the same filesystem
        return f"train.storage {root}", local

    def disk_full(self, exc: BaseException, *, checkpoint: bool = False) -> bool:
        """Whether a failed write looks like a full or read-only disk: an OSError saying so anywhere in the
        chain (a trainer in another process reports it as text), or almost no space left on the disk written to
        (the checkpoint store's, with `checkpoint`)."""
        chain, seen = [], exc
        while seen is not None:
            chain.append(seen)
            seen = seen.__cause__ or seen.__context__
        if any(isinstance(e, OSError) and e.errno in _DISK_ERRNOS for e in chain):
            return True
        if any(text in str(e) for e in chain for text in ("No space left", "Read-only file system", "quota")):
            return True
        _, local = self._disk(checkpoint)
        try:
            usage = shutil.disk_usage(local)
        except (OSError, TypeError):
            return False
        return usage.free < min(64 * 2**20, usage.total // 100)

    def disk_problem(self, exc: BaseException, *, checkpoint: bool = False) -> str:
        """One line for a write that failed (full or read-only disk): which disk (the checkpoint store's, with
        `checkpoint`), its free space, and what is safe."""
        what, local = self._disk(checkpoint)
        try:
            usage = shutil.disk_usage(local)
            space = f"{usage.free / 2**20:.0f} MB free of {usage.total / 2**20:.0f} MB"
        except (OSError, TypeError):
            space = "free space unknown (an object store)" if local is None else "free space unknown"
        try:
            last = self.latest_checkpoint()
            keep = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
        except (OSError, StorageError):
            keep = "the checkpoints cannot be listed now"
        return (f"writing to {what} failed ({' '.join(str(exc).split())}; disk: {space}); {keep}; free space "
                f"or make the disk writable, then: marsi resume {self.dir}")

    def steps_done(self) -> int | None:
        """The step of the newest intact checkpoint, or None."""
        for path in reversed(self.checkpoints()):
            if checkpoint_problem(path) is None:
                return read_checkpoint_state(path)["step"]
        return None

    # ------------------------------------------------------------------------------------ records
    def write_config(self, config: RunConfig) -> None:
        (self.dir / "config.yaml").write_text(yaml.safe_dump(stored_form(config), sort_keys=False))

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
        self._close_loggers()  # before their directories go
        for name in ("config.yaml", "metrics.jsonl", "transcripts.jsonl", ".lock", STORE_RECORD):
            (self.dir / name).unlink(missing_ok=True)
        for name in ("source", "tensorboard", "wandb"):
            shutil.rmtree(self.dir / name, ignore_errors=True)
        if self._release_lease():  # nothing of the store is touched where another marsi holds the run's lease
            with contextlib.suppress(OSError, StorageError):  # its checkpoints (a new run found their place empty)
                if not self._unreachable:
                    storage.delete(self.checkpoint_dir())
            self._remove_empty_place()
        with contextlib.suppress(OSError):
            self.dir.rmdir()  # only if nothing else is in it
        return True

    def log_metrics(self, metrics: dict[str, Any]) -> None:
        with open(self.dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        for logger in self.loggers:
            logger.log(metrics)

    def log_eval(self, row: dict[str, Any]) -> None:
        """Append one `marsi eval` result to eval.jsonl (only `marsi eval` writes it, so a live run is left alone)."""
        with open(self.dir / "eval.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def log_transcripts(self, step: int, transcripts: list[dict[str, Any]], *, name: str = TRANSCRIPTS,
                        max_mb: float | None = None) -> bool:
        """Append whole episodes of `step` to `name`, unless that would take the file past `max_mb`: then they
        and every later step's are left out, said once on stderr. False when left out. The loggers (W&B's
        episode tables) get the episodes written, the same."""
        if not transcripts:
            return True
        text = "".join(json.dumps({"step": step, **t}) + "\n" for t in transcripts)
        path = self.dir / name
        if name in self._full or (max_mb is not None and (_size(path) or 0) + len(text.encode()) > max_mb * 1e6):
            if name not in self._full:
                self._full.add(name)
                print(f"marsi: {path} has reached train.transcripts_max_mb ({max_mb:g} MB); from step {step} on no more "
                      "episodes are written to it (metrics go on); raise the bound to keep more", file=sys.stderr, flush=True)
            return False
        with open(path, "a") as f:
            f.write(text)
        for logger in self.loggers:
            logger.log_episodes(step, transcripts, evaluation=name == EVAL_TRANSCRIPTS)
        return True

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (they are replayed after a resume): each file is streamed
        into a new one beside it, which then replaces it, so a crash at any moment leaves one whole file."""
        for name in ("metrics.jsonl", TRANSCRIPTS, EVAL_TRANSCRIPTS):
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
        for logger in self.loggers:
            logger.truncate_after(step)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / "metrics.jsonl")

    # -------------------------------------------------------------------------------- checkpoints
    def place(self) -> Location:
        """The run's place in its store: the run directory, or STORAGE/RUN_NAME (as RUN_DIR/store.json records it,
        so a renamed run directory still finds it; RUN_NAME is the run directory's name when the run began)."""
        if self.storage is None:
            return Location.parse(self.dir, self.deadline_s)
        return self._place or self._storage_root() / self.dir.resolve().name

    def _storage_root(self) -> Location:
        return Location.parse(self.storage, self.deadline_s)

    def checkpoint_dir(self) -> Location:
        """Where this run's checkpoints go: RUN_DIR/checkpoints, or STORAGE/RUN_NAME/checkpoints."""
        return self.place() / "checkpoints"

    def staging_path(self, step: int) -> Location:
        """Where to write the checkpoint of `step`: its own place in the store, emptied (its commit record first)."""
        self._confirm_lease()
        place = self.checkpoint_dir() / str(CheckpointName(step))
        storage.delete(place, first=CHECKPOINT_DONE)
        return place

    def abort_checkpoint(self, staging: Location) -> None:
        """Remove a checkpoint that will not be committed (it only takes space), its commit record first; nothing
        where this process no longer holds the run's lease."""
        if not self.owns_place():
            return
        with contextlib.suppress(OSError, StorageError):
            storage.delete(staging, first=CHECKPOINT_DONE)

    def commit_checkpoint(self, staging: Location, step: int, state: dict[str, Any], keep: int,
                          files: dict[str, tuple[str, int]]) -> Location:
        """Check that every file the trainers reported (`files`: name -> (sha256, size)) is there, write the
        coordinator state with that manifest and a checksum of itself last (whole or not at all), keep the
        newest `keep`, and remove what failed checkpoints left."""
        present = storage.file_sizes(staging)
        for name, (_, size) in sorted(files.items()):
            found = present.get(name)
            if found != size:
                where = "is not there" if found is None else f"is {found} bytes there, not {size}"
                raise StorageError(f"checkpoint {CheckpointName(step)}: {name}, which its trainer reported writing ({size} bytes), "
                                   f"{where} as this coordinator sees {staging}; every node must reach the same "
                                   "checkpoint storage (train.storage)")
        record = {**state, "manifest": {name: digest for name, (digest, _) in files.items()},
                  "sizes": {name: size for name, (_, size) in files.items()}}
        self._confirm_lease()
        storage.commit_bytes(staging / CHECKPOINT_DONE, json.dumps({**record, "sha256": record_digest(record)}).encode())
        for old in self.checkpoints()[:-keep]:
            self.abort_checkpoint(old)
        self._sweep(keep=staging)
        return staging

    def _sweep(self, keep: Location) -> None:
        """Remove what earlier, failed checkpoints left: directories below the checkpoints that were never
        committed (`step-N/` without its record; `.tmp-step-N/` of earlier marsi versions)."""
        root = self.checkpoint_dir()
        for name in storage.subdirectories(root):
            place = root / name
            if place != keep and not storage.exists(place / CHECKPOINT_DONE):
                self.abort_checkpoint(place)

    def checkpoints(self) -> list[Location]:
        """Complete checkpoints, oldest first (by step number, not by name)."""
        return complete_checkpoints(self.checkpoint_dir())

    def find_checkpoint(self, name: str) -> Location | None:
        """The complete checkpoint a user names (`step-000015` or `step-15`), or None."""
        wanted = CheckpointName.parse(name)
        return next((c for c in self.checkpoints() if CheckpointName.of(c) == wanted), None) if wanted else None

    def latest_checkpoint(self) -> Location | None:
        found = self.checkpoints()
        return found[-1] if found else None

    # ------------------------------------------------------------------------------------ probes
    def write_probe(self, token: str) -> None:
        """A file where trainers prove they reach the run's checkpoints (`agent_trainer.storage.probe`)."""
        storage.write_bytes(self.checkpoint_dir() / f"{storage.PROBE_PREFIX}{token}", token.encode())

    def probe_answered(self, token: str, agent: str) -> bool:
        try:
            answer = storage.read_bytes(self.checkpoint_dir() / f"{storage.PROBE_PREFIX}{token}-{agent}")
        except OSError:
            return False
        return answer == token.encode()

    def remove_probes(self, token: str, agents: list[str]) -> None:
        for name in [f"{storage.PROBE_PREFIX}{token}", *(f"{storage.PROBE_PREFIX}{token}-{a}" for a in agents)]:
            with contextlib.suppress(OSError, StorageError):
                storage.delete_file(self.checkpoint_dir() / name)


def recorded_place(run_dir: Path, deadline_s: float | None = DEFAULT_STORE_DEADLINE_S) -> Location | None:
    """The run's place in storage as RUN_DIR/store.json records it (None: no record, as in runs of older marsi)."""
    try:
        return Location.parse(json.loads((run_dir / STORE_RECORD).read_text())["place"], deadline_s)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _recorded_train(run_dir: Path) -> dict:
    """The train section a run directory's config.yaml records ({}: none, or no config yet)."""
    try:
        train = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return {}
    return train if isinstance(train, dict) else {}


def _recorded_storage(train: dict) -> str | None:
    """The train.storage of a recorded train section (None: none)."""
    value = train.get("storage")
    return value if isinstance(value, str) else None


def _recorded_deadline(train: dict) -> float | None:
    """The train.storage_timeout_s of a recorded train section (its default where none is, or one that is no
    positive number of seconds)."""
    value = train.get("storage_timeout_s", DEFAULT_STORE_DEADLINE_S)
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        return value
    return DEFAULT_STORE_DEADLINE_S


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


def _jsonl_lines(path: Path, stream: IO[str] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, row) of a JSON-lines file (read from `stream` if given, `path` naming it). A torn final line (a crash or
    full disk mid-append) is dropped and reported; a corrupt line elsewhere is a one-line error naming the file and
    line."""
    with open(path) if stream is None else stream as f:
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


def read_jsonl(path: Path, stream: IO[str] | None = None) -> list[dict[str, Any]]:
    if stream is None and not path.exists():
        return []
    return [row for _, row in _jsonl_lines(path, stream)]


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None
