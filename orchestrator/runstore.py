"""A run's state in its store (`train.storage`): the run directory's records go into every checkpoint, so that
the store alone holds the run, and a run directory can be fetched back from it.

    STORAGE/RUN_NAME/checkpoints/step-N/agents/NAME/...      the trainers' files
    STORAGE/RUN_NAME/checkpoints/step-N/run/config.yaml      the run directory's records as they were at step N:
                                                             metrics.jsonl, source/
    STORAGE/RUN_NAME/checkpoints/step-N/coordinator.json     written last: its manifest covers run/ too, and its
                                                             `records` list the transcripts' segments
    STORAGE/RUN_NAME/records/transcripts.jsonl/SHA256        segments of the transcripts files (and of
                                                             eval_transcripts.jsonl), named by their contents
    STORAGE/RUN_NAME/eval.jsonl                              `marsi eval`'s rows (it runs beside or after a run)

The records are uploaded by the coordinator with each checkpoint, before its `coordinator.json`, so they are
committed with it, whole or not at all, checked by the same checksums, and pruned with it. They hold the steps
up to N only: a resume replays the later ones, as from any checkpoint. The transcripts files, which grow by every
step's episodes and can reach gigabytes, are not uploaded whole each time: a checkpoint lists them as segments
(sha256, size) whose concatenation is the file at step N, and only the bytes appended since the newest committed
checkpoint go up, as one new segment (a file rewritten below what that checkpoint holds, after a resume from an
older one, starts a segment where the two part). Segments are shared by checkpoints and removed once no kept
checkpoint lists them. `fetch_run` makes a run directory from the newest complete checkpoint whose records are
intact (written aside, renamed into place once whole); `marsi resume | eval | export | plot | report` take the
run's place in the store (`STORAGE/RUN_NAME`) wherever they take a run directory. A run directory whose records are
not those of the checkpoint a resume goes on from (older: another machine went on from the store) is brought up to
it (`reconcile`); the run's lease (`orchestrator/lease.py`) keeps a second writer out.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator

from agent_trainer import storage
from orchestrator import lease
from orchestrator.checkpoint_files import (
    EVAL_TRANSCRIPTS, SEGMENTS, TRANSCRIPTS, checkpoint_problem, complete_checkpoints, read_checkpoint_state,
)
from orchestrator.runlog import (
    STORE_RECORD, RunDirError, RunLog, holds_run, lock_dir, recorded_place,
)
from protocols.config import ConfigError, credentials_problem
from protocols.messages import Location

RECORDS = ("config.yaml", "metrics.jsonl")
"""The run directory's files that each checkpoint in a store carries whole (under run/), besides source/."""
APPENDED = (TRANSCRIPTS, EVAL_TRANSCRIPTS)
"""The run directory's files that each checkpoint lists as segments (`records`): only what was appended goes up."""
RUN = "run"
EVAL_ROWS = "eval.jsonl"


def mirror(log: RunLog, checkpoint: Location) -> dict[str, tuple[str, int]]:
    """Upload the run directory's records into `checkpoint`/run/ (a checkpoint being written, not yet committed);
    their manifest entries: `run/NAME` -> (sha256, size)."""
    files = {}
    for name in [*RECORDS, *(f"source/{p.name}" for p in sorted((log.dir / "source").glob("*")) if p.is_file())]:
        path = log.dir / name
        if path.is_file():
            files[f"{RUN}/{name}"] = storage.upload_file(path, checkpoint / RUN / name)
    return files


def append_records(log: RunLog) -> dict[str, list[list]]:
    """Upload what the transcripts files gained since the newest committed checkpoint, as one new segment each;
    every file's segments, [sha256, size] in order, for the checkpoint being written (`records` of its state)."""
    newest = log.latest_checkpoint()
    before = read_checkpoint_state(newest).get("records", {}) if newest is not None else {}
    records = {}
    for name in APPENDED:
        path = log.dir / name
        if path.is_file():
            records[name] = _append(path, before.get(name, []), log.place() / SEGMENTS / name)
    return records


def _append(path: Path, segments: list[list], where: Location) -> list[list]:
    """The segments of the file at `path`: the leading ones of `segments` that it still holds byte for byte (read
    back here, not trusted), then one of the rest, uploaded unless the store has it already."""
    kept, offset = [], 0
    with open(path, "rb") as f:
        for digest, size in segments:
            if storage.hash_part(f, size) != (digest, size):
                break
            kept.append([digest, size])
            offset += size
        f.seek(offset)
        digest, size = storage.hash_part(f, path.stat().st_size - offset)
    if not size:
        return kept
    if storage.file_sizes(where).get(digest) != size:  # absent, or cut short by a killed upload
        storage.upload_part(path, offset, size, where / digest)
    return [*kept, [digest, size]]


def prune_records(log: RunLog) -> None:
    """Remove the segments no complete checkpoint lists (those of pruned checkpoints and of failed ones)."""
    listed = set()
    for checkpoint in log.checkpoints():
        try:
            listed |= {digest for segments in read_checkpoint_state(checkpoint).get("records", {}).values()
                       for digest, _ in segments}
        except ValueError:
            return  # an unreadable checkpoint may list any: keep them all
    root = log.place() / SEGMENTS
    for name in storage.file_sizes(root):
        if name.rsplit("/", 1)[-1] not in listed:
            storage.delete_file(root / name)


def is_place(target: str | Path) -> bool:
    """Whether `target` names a run's place in a store (a URI, or a directory holding `checkpoints/` but no
    config.yaml) rather than a run directory."""
    text = str(target)
    if "://" in text:
        return True
    path = Path(text)
    return path.is_dir() and not (path / "config.yaml").exists() and (path / "checkpoints").is_dir()


def as_place(target: str | Path) -> Location:
    """The run's place a target names; its `checkpoints` directory names it too. A URI with credentials in it is
    refused (ConfigError), as in train.storage."""
    problem = credentials_problem(str(target), "the run's place in storage")
    if problem:
        raise ConfigError(problem)
    place = Location.parse(target)
    return Location.parse(str(place)[: -len("/checkpoints")]) if place.name == "checkpoints" else place


def fetch_run(place: Location, run_dir: Path) -> Location:
    """Make `run_dir` (new, or empty) the run directory of the run at `place` in a store: its records as the newest
    checkpoint whose records are intact has them (a damaged one is said and skipped for the one before), the run's
    `marsi eval` rows, and a record of `place`; the checkpoint. The records are written aside, in a hidden directory
    beside `run_dir`, and renamed into place once whole: a fetch cut short or failed leaves no run directory. A
    `run_dir` that already is this run's directory is brought up to the store instead (`bring_up`)."""
    if is_run_of(run_dir, place):
        return bring_up(run_dir) or RunLog(run_dir).latest_checkpoint()
    if holds_run(run_dir) or (run_dir.is_dir() and any(run_dir.iterdir())):
        raise RunDirError(f"{run_dir}: not empty; give a new directory for the run fetched from {place} with --run-dir, "
                          "or resume the run directory itself")
    _sweep_unfinished(run_dir.parent, f".{run_dir.name}")
    made = [p for p in reversed(run_dir.parents) if not p.exists()]
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    aside = run_dir.parent / f".{run_dir.name}{FETCHING}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        checkpoint = _fetch_newest(place, aside)
        if storage.exists(place / EVAL_ROWS):
            (aside / EVAL_ROWS).write_bytes(storage.read_bytes(place / EVAL_ROWS))
        (aside / STORE_RECORD).write_text(json.dumps({"place": str(place)}) + "\n")
        if run_dir.is_dir():
            run_dir.rmdir()  # empty (checked above)
        os.rename(aside, run_dir)
    except BaseException:
        shutil.rmtree(aside, ignore_errors=True)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()  # made for this fetch; only if still empty
        raise
    return checkpoint


def is_run_of(run_dir: Path, place: Location) -> bool:
    """Whether `run_dir` holds the run whose place in a store is `place` (as its store.json records it; a path and
    a `file://` URI of it name the same place)."""
    recorded = recorded_place(run_dir)
    if recorded is None or not holds_run(run_dir):
        return False
    if str(recorded) == str(place):
        return True
    (mine, at), (theirs, there) = storage._fs(recorded), storage._fs(place)
    return type(mine.raw) is type(theirs.raw) and isinstance(mine.raw, storage._local_fs()) and at == there


FETCHING = ".fetch-"
"""In the name of the hidden directory a fetch writes into (`.RUN_NAME.fetch-PID-RANDOM`) before it is renamed."""


def _sweep_unfinished(folder: Path, prefix: str) -> None:
    """Remove the hidden directories (`PREFIX.fetch-PID-*` in `folder`) of fetches whose process is gone (killed
    mid-fetch)."""
    for path in folder.glob(f"{prefix}{FETCHING}*") if folder.is_dir() else []:
        pid = path.name.rsplit(FETCHING, 1)[1].split("-", 1)[0]
        if pid.isdigit() and not storage._alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _fetch_newest(place: Location, into: Path) -> Location:
    """Fetch into `into` the records of the newest checkpoint at `place` whose records are intact, falling back past
    damaged ones (said on stderr); the checkpoint. FileNotFoundError naming what was found when there is none."""
    root = place / "checkpoints"
    found = list(reversed(complete_checkpoints(root)))
    held, problem = [c for c in found if _has_records(c)], None
    for i, checkpoint in enumerate(held):
        shutil.rmtree(into, ignore_errors=True)
        into.mkdir()
        problem = checkpoint_problem(checkpoint) or _fetch_records(place, checkpoint, into)
        if problem is None:
            return checkpoint
        if i + 1 < len(held):
            _say(f"checkpoint {checkpoint.name} is damaged ({problem}); falling back to {held[i + 1].name}")
    if problem is not None:
        raise FileNotFoundError(f"{place}: the records of every complete checkpoint in {root} are damaged ({len(held)}; "
                                f"the oldest, {held[-1].name}: {problem}); resume a run directory of this run instead "
                                "(marsi resume RUN_DIR), or put the store's files back")
    have = (f"{len(found)} complete checkpoint(s), none with the run's records (written by an older marsi?)" if found
            else "no complete checkpoint")
    raise FileNotFoundError(f"{place}: looked for the run's records in {root} and found {have}; give a run's place in "
                            "storage, STORAGE/RUN_NAME, as `marsi run` printed it")


def _has_records(checkpoint: Location) -> bool:
    """Whether a checkpoint carries the run's records (those of older marsi versions do not); a damaged one may."""
    try:
        return f"{RUN}/config.yaml" in read_checkpoint_state(checkpoint)["manifest"]
    except ValueError:
        return True  # said to be damaged where it is tried


def _fetch_records(place: Location, checkpoint: Location, into: Path) -> str | None:
    """Write the run's records as `checkpoint` holds them into the directory `into`, each file checked against its
    checksum as it streams; why they cannot be trusted, or None."""
    state = read_checkpoint_state(checkpoint)
    wanted = {name.removeprefix(f"{RUN}/"): digest for name, digest in state["manifest"].items()
              if name.startswith(f"{RUN}/")}
    problem = storage.download(checkpoint / RUN, wanted, into)
    if problem:
        return f"{RUN}/{problem}"
    for name, segments in state.get("records", {}).items():
        problem = _join(place / SEGMENTS / name, segments, into / name)
        if problem:
            return problem
    return None


def _join(where: Location, segments: list[list], path: Path) -> str | None:
    """Write the file `segments` (at `where`) make up at `path`, each checked against its sha256 as it streams; why
    it cannot be trusted, or None."""
    with open(path, "wb") as out:
        for digest, size in segments:
            try:
                if storage.append_to(where / digest, out) != (digest, size):
                    return f"{SEGMENTS}/{where.name}/{digest} does not match its checksum"
            except FileNotFoundError:
                return f"{SEGMENTS}/{where.name}/{digest} is missing"
    return None


def bring_up(run_dir: Path) -> Location | None:
    """Bring the records of `run_dir`, a run directory whose checkpoints are in a store, up to the newest checkpoint
    there whose records are intact, unless they hold that checkpoint's records already (they may go further: steps
    not yet checkpointed); the checkpoint, or None (a run without a store, or no such checkpoint). See `reconcile`."""
    log = RunLog(run_dir)
    if log.storage is None:
        return None
    lock = lock_dir(run_dir)
    try:
        held = [c for c in reversed(log.checkpoints()) if _has_records(c)]
        for i, checkpoint in enumerate(held):
            problem = checkpoint_problem(checkpoint) or reconcile(log, checkpoint)
            if problem is None:
                return checkpoint
            if i + 1 < len(held):
                _say(f"checkpoint {checkpoint.name} is damaged ({problem}); falling back to {held[i + 1].name}")
    finally:
        lock.close()
    return None


def reconcile(log: RunLog, checkpoint: Location) -> str | None:
    """Make the run directory of a run with train.storage hold the records of `checkpoint`: kept where its metrics
    and transcripts begin with the checkpoint's (`holds_records`), else (an older or another history) replaced by
    the checkpoint's, fetched aside and checked first, the directory's own files (TensorBoard, W&B, plots) kept. Why
    the checkpoint's records cannot be trusted (nothing is changed then), or None. The caller holds the run
    directory's lock."""
    if log.storage is None or str(checkpoint.parent) != str(log.checkpoint_dir()):
        return None  # records in the run directory only; or a checkpoint of another run, restored by hand
    state = read_checkpoint_state(checkpoint)
    if f"{RUN}/config.yaml" not in state["manifest"] or holds_records(log.dir, state):
        return None
    _sweep_unfinished(log.dir, "")
    aside = log.dir / f"{FETCHING}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        aside.mkdir()
        problem = _fetch_records(log.place(), checkpoint, aside)
        if problem is not None:
            return problem
        for name in (*RECORDS, *APPENDED):
            if (aside / name).is_file():
                os.replace(aside / name, log.dir / name)
            else:
                (log.dir / name).unlink(missing_ok=True)  # not in the store's history up to this checkpoint
        shutil.rmtree(log.dir / "source", ignore_errors=True)
        if (aside / "source").is_dir():
            os.rename(aside / "source", log.dir / "source")
        if storage.exists(log.place() / EVAL_ROWS):
            (log.dir / EVAL_ROWS).write_bytes(storage.read_bytes(log.place() / EVAL_ROWS))
    finally:
        shutil.rmtree(aside, ignore_errors=True)
    _say(f"{log.dir}: its records are not those of the run's checkpoint {checkpoint.name} in the store (older, or "
         "another history); brought them up to it")
    return None


def holds_records(run_dir: Path, state: dict) -> bool:
    """Whether the run directory's metrics and transcripts begin with those of the checkpoint whose state is `state`,
    byte for byte (they may go on past it)."""
    metrics = f"{RUN}/metrics.jsonl"
    if metrics in state["manifest"]:
        size = state.get("sizes", {}).get(metrics)
        if size is None or not _begins_with(run_dir / "metrics.jsonl", [[state["manifest"][metrics], size]]):
            return False
    return all(_begins_with(run_dir / name, segments) for name, segments in state.get("records", {}).items())


def _begins_with(path: Path, segments: list[list]) -> bool:
    try:
        with open(path, "rb") as f:
            return all(storage.hash_part(f, size) == (digest, size) for digest, size in segments)
    except FileNotFoundError:
        return not segments


def fetched_run_dir(place: Location) -> Path:
    """Where `marsi resume STORAGE/RUN_NAME` puts the run directory it fetches: `runs/RUN_NAME` (below the
    current directory)."""
    return Path("runs") / place.name


@contextlib.contextmanager
def resumable(target: str | Path, fetch_to: str | Path | None = None, *,
              take_over: bool = False) -> Iterator[tuple[Path, Location | None]]:
    """The run directory a resume of `target` goes on in, and the checkpoint fetched into it (None: none was). A
    run's place in a store (`STORAGE/RUN_NAME`) is fetched into `fetch_to` (new or empty; default
    `fetched_run_dir`), or, where that is this run's directory already, brought up to the store; so is a run
    directory whose checkpoints are in a store. Either way the run's lease is checked first
    (`lease.held_by_other`): a run that another live marsi writes is refused before anything is fetched or changed.
    A directory fetched here is removed again if the body raises (a resume refused after the fetch leaves none)."""
    fetched, checkpoint = None, None
    if is_place(target):
        place = as_place(target)
        lease.held_by_other(place, take_over=take_over)
        run_dir = Path(fetch_to) if fetch_to is not None else fetched_run_dir(place)
        new = not is_run_of(run_dir, place)
        checkpoint = fetch_run(place, run_dir)
        fetched = run_dir if new else None
    else:
        run_dir = Path(target)
        log = RunLog(run_dir)
        if log.storage is not None and holds_run(run_dir):
            lease.held_by_other(log.place(), take_over=take_over)
            bring_up(run_dir)
    try:
        yield run_dir, checkpoint if fetched is not None else None
    except BaseException:
        if fetched is not None:
            shutil.rmtree(fetched, ignore_errors=True)
        raise


def _say(message: str) -> None:
    print(f"marsi: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def run_view(target: str | Path) -> Iterator[Path]:
    """A run directory for `target`: itself, or (a run's place in a store) a temporary one fetched from it, named
    as the run, removed afterwards."""
    if not is_place(target):
        yield Path(target)
        return
    place = as_place(target)
    with tempfile.TemporaryDirectory(prefix="marsi-run-") as tmp:
        run_dir = Path(tmp) / place.name
        fetch_run(place, run_dir)
        yield run_dir


def append_eval_rows(log: RunLog, rows: list[dict]) -> None:
    """Add `marsi eval` rows to STORAGE/RUN_NAME/eval.jsonl, the file put in place whole (a run without storage:
    nothing; its run directory's eval.jsonl is the record)."""
    if log.storage is None or not rows:
        return
    place = log.place() / EVAL_ROWS
    before = storage.read_bytes(place) if storage.exists(place) else b""
    storage.commit_bytes(place, before + "".join(json.dumps(r) + "\n" for r in rows).encode())
