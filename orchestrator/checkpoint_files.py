"""A checkpoint's files in its store: their names (`CheckpointName`), the record written last
(`coordinator.json`: the coordinator state and the manifest of every file), and the checks before a load.
`orchestrator.runlog` writes, lists and prunes checkpoints with these."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from agent_trainer import storage
from protocols.config import ConfigError
from protocols.messages import DEFAULT_STORE_DEADLINE_S, Location

CHECKPOINT_DONE = "coordinator.json"  # written last: a checkpoint without it is incomplete
TRANSCRIPTS = "transcripts.jsonl"
EVAL_TRANSCRIPTS = "eval_transcripts.jsonl"
SEGMENTS = "records"  # with train.storage: STORAGE/RUN_NAME/records/NAME/SHA256, the transcripts' segments
_STATE_KEYS = ("step", "episodes", "data", "baselines", "manifest")


@dataclass(frozen=True, order=True)
class CheckpointName:
    """The name of the checkpoint of a step: `step-000015` for step 15, as written; `step-15` names it too
    wherever a user names a checkpoint (`parse`)."""

    step: int

    PREFIX: ClassVar[str] = "step-"

    @classmethod
    def parse(cls, name: str) -> CheckpointName | None:
        """The checkpoint `name` (`step-N`, N of any width) names, or None if it names none."""
        digits = name.removeprefix(cls.PREFIX)
        if digits == name or not digits.isdigit():
            return None
        return cls(int(digits))

    @classmethod
    def of(cls, checkpoint: Location) -> CheckpointName:
        """The name of a checkpoint directory (one `RunLog.checkpoints` lists)."""
        name = cls.parse(checkpoint.name)
        if name is None:
            raise ValueError(f"{checkpoint}: not a checkpoint directory (its name is not {cls.PREFIX}N)")
        return name

    def __str__(self) -> str:
        return f"{self.PREFIX}{self.step:06d}"


def complete_checkpoints(root: Location) -> list[Location]:
    """The complete checkpoints below `root` (a run's `checkpoints`), oldest first (by step number, not by name)."""
    found = [root / name for name in storage.subdirectories(root) if CheckpointName.parse(name)]
    return sorted((c for c in found if storage.exists(c / CHECKPOINT_DONE)), key=CheckpointName.of)


def as_checkpoint(path: str | Path | Location, deadline_s: float | None = DEFAULT_STORE_DEADLINE_S) -> Location:
    """A checkpoint given by the user: a URI (`s3://...`, `file://...`) or a path (a `file://` location), whose
    calls to the store keep `deadline_s` (a `Location` keeps its own)."""
    return path if isinstance(path, Location) else Location.parse(path, deadline_s)


def read_checkpoint_state(path: Location) -> dict[str, Any]:
    """The coordinator state of the checkpoint at `path`; ValueError unless it is whole and unaltered."""
    try:
        raw = json.loads(storage.read_bytes(path / CHECKPOINT_DONE))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{CHECKPOINT_DONE} unreadable ({type(exc).__name__})") from None
    if not isinstance(raw, dict) or "sha256" not in raw:
        raise ValueError(f"{CHECKPOINT_DONE} has no checksum of itself")
    digest = raw.pop("sha256")
    if record_digest(raw) != digest:
        raise ValueError(f"{CHECKPOINT_DONE} does not match its checksum")
    missing = [k for k in _STATE_KEYS if k not in raw]
    if missing:
        raise ValueError(f"{CHECKPOINT_DONE} lacks {', '.join(missing)}")
    return raw


def checkpoint_problem(path: Location) -> str | None:
    """Why the checkpoint at `path` must not be loaded (a missing, truncated or altered file), or None. Its
    record and each file's presence and size are checked here; each file's checksum on the trainer's node
    that loads it (`agent_trainer.storage.load`), so that no agent's weights travel to the coordinator."""
    try:
        state = read_checkpoint_state(path)
    except ValueError as exc:
        return str(exc)
    try:
        present = storage.file_sizes(path)
    except OSError as exc:
        return f"its files cannot be listed ({' '.join(str(exc).split())})"
    for name in state["manifest"]:
        if not _inside(name):
            return f"its manifest names {name!r}, a path outside the checkpoint"
        if name not in present:
            return f"{name} is missing"
        recorded = state.get("sizes", {}).get(name)
        if recorded is not None and present[name] != recorded:
            return f"{name} does not match its checksum (it is {present[name]} bytes, not {recorded})"
    for name, segments in state.get("records", {}).items():  # the transcripts' segments, beside the checkpoints
        if name not in (TRANSCRIPTS, EVAL_TRANSCRIPTS) or not all(_is_digest(digest) for digest, _ in segments):
            return f"its records name {name!r}, which is not a transcripts file of the run's segments"
        try:
            stored = storage.file_sizes(path.parent.parent / SEGMENTS / name)
        except OSError as exc:
            return f"its records cannot be listed ({' '.join(str(exc).split())})"
        for digest, size in segments:
            if stored.get(digest) != size:
                return f"{SEGMENTS}/{name}/{digest} is {'missing' if digest not in stored else 'cut short'}"
    return None


def _inside(name: str) -> bool:
    """Whether a manifest's relative name stays inside its checkpoint (a store shared with others may hold a crafted
    `coordinator.json`: its names become paths where the files are downloaded)."""
    return bool(name) and not name.startswith("/") and all(part not in ("", ".", "..") for part in name.split("/"))


def _is_digest(text: object) -> bool:
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def agent_files(checkpoint: Location, agent: str) -> dict[str, str]:
    """The files of `agent` in the checkpoint's manifest: name relative to its directory -> sha256."""
    prefix = f"agents/{agent}/"
    return {name.removeprefix(prefix): digest for name, digest in read_checkpoint_state(checkpoint)["manifest"].items()
            if name.startswith(prefix)}


def record_digest(record: dict[str, Any]) -> str:
    """The SHA-256 of a record as JSON with sorted keys: what a checkpoint's record holds of itself."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def checkpoint_path(name: str, log) -> Location:
    """The checkpoint of the run `log` keeps that a user names: `last` (the newest complete one) or `step-N`."""
    found = log.checkpoints()  # oldest first
    if name == "last":
        if not found:
            raise ConfigError(f"{log.dir}: no complete checkpoint to evaluate; evaluate its initial models with "
                              "--checkpoint initial, or wait for the run's first checkpoint (train.checkpoint_every)")
        return found[-1]
    checkpoint = log.find_checkpoint(name)
    if checkpoint is None:
        raise ConfigError(f"{log.dir}: no checkpoint {name!r}; have initial, last, "
                          f"{', '.join(p.name for p in found) or '(none)'}")
    return checkpoint
