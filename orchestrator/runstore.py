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
checkpoint lists them. `fetch_run` makes a run directory from the newest complete checkpoint that holds the
records; `marsi resume | eval | export | plot | report` take the run's place in the store (`STORAGE/RUN_NAME`)
wherever they take a run directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Iterator

from agent_trainer import storage
from orchestrator.runlog import (
    EVAL_TRANSCRIPTS, SEGMENTS, STORE_RECORD, TRANSCRIPTS, RunDirError, RunLog, checkpoint_problem,
    complete_checkpoints, holds_run, read_checkpoint_state, recorded_place,
)
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
    """The run's place a target names; its `checkpoints` directory names it too."""
    place = Location.parse(target)
    return Location.parse(str(place)[: -len("/checkpoints")]) if place.name == "checkpoints" else place


def fetch_run(place: Location, run_dir: Path) -> Location:
    """Make `run_dir` (new, or empty) the run directory of the run at `place` in a store: its records as the newest
    complete checkpoint that holds them has them, the run's `marsi eval` rows, and a record of `place`; the
    checkpoint. A `run_dir` that already is this run's directory is left as it is (it may be newer)."""
    if recorded_place(run_dir) is not None and str(recorded_place(run_dir)) == str(place) and holds_run(run_dir):
        return RunLog(run_dir).latest_checkpoint()
    if holds_run(run_dir) or (run_dir.is_dir() and any(run_dir.iterdir())):
        raise RunDirError(f"{run_dir}: not empty; give a new directory for the run fetched from {place} with --run-dir, "
                          "or resume the run directory itself")
    checkpoint = newest_with_records(place)
    state = read_checkpoint_state(checkpoint)
    wanted = {name.removeprefix(f"{RUN}/"): digest for name, digest in state["manifest"].items()
              if name.startswith(f"{RUN}/")}
    run_dir.mkdir(parents=True, exist_ok=True)
    problem = storage.download(checkpoint / RUN, wanted, run_dir)
    problem = f"{RUN}/{problem}" if problem else None
    for name, segments in state.get("records", {}).items():
        problem = problem or _join(place / SEGMENTS / name, segments, run_dir / name)
    if problem:
        raise FileNotFoundError(f"checkpoint {checkpoint}: {problem}")
    if storage.exists(place / EVAL_ROWS):
        (run_dir / EVAL_ROWS).write_bytes(storage.read_bytes(place / EVAL_ROWS))
    (run_dir / STORE_RECORD).write_text(json.dumps({"place": str(place)}) + "\n")
    return checkpoint


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


def newest_with_records(place: Location) -> Location:
    """The newest checkpoint at `place` that is complete and intact as listed and holds the run's records."""
    root = place / "checkpoints"
    found = complete_checkpoints(root)
    for checkpoint in reversed(found):
        if checkpoint_problem(checkpoint) is None and f"{RUN}/config.yaml" in read_checkpoint_state(checkpoint)["manifest"]:
            return checkpoint
    have = f"{len(found)} complete checkpoint(s), none with the run's records (written by an older marsi?)" if found \
        else "no complete checkpoint"
    raise FileNotFoundError(f"{place}: looked for the run's records in {root} and found {have}; give a run's place in "
                            "storage, STORAGE/RUN_NAME, as `marsi run` printed it")


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
