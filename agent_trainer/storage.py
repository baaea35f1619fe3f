"""Checkpoint storage: where checkpoints live, and how a trainer puts its files there and gets them back.

`train.storage` chooses one of two kinds:

- **The run directory** (default): `RUN_DIR/checkpoints`, a plain local path (a `pathlib.Path`). Every node
  that hosts a trainer must see it (one machine, or a filesystem all nodes share): trainers write their
  files into it directly and the coordinator renames the checkpoint into place. The coordinator checks
  at start that every trainer's node sees it (`probe`).
- **A filesystem URI** (`s3://`, `gs://`, `hdfs://`, `file://`, or an absolute path on a shared filesystem
  such as NFS), reached through `pyarrow.fs`, the filesystem layer Ray's own storage uses. A place in it is
  a `Location`. Each trainer saves into a node-local staging directory (under the node's TMPDIR), uploads
  its files, reports their checksums and sizes, and removes the staging directory; a restore downloads
  into a staging directory on the trainer's node, checks every file against the manifest, loads, and
  removes it. Nothing passes through the coordinator, and no file is ever held whole in memory.

The functions `save`, `load` and `probe` run in a trainer's process (Ray actor or in-process) with the
trainer as first argument: the agent's handle methods of those names (`agent_trainer.agent.Agent`) call them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from protocols.errors import UserError
from protocols.messages import StoredFiles

CHUNK = 8 << 20  # bytes read or written at a time: a file is streamed, never held whole
STAGING_PREFIX = "marsi-ckpt-"  # node-local staging directories: marsi-ckpt-<pid>-<random>
PROBE_PREFIX = ".marsi-probe-"


class StorageError(UserError, RuntimeError):
    """Checkpoint storage is unusable as configured (not shared by every node, unreachable, ...)."""


@functools.lru_cache(maxsize=16)
def _filesystem(root: str):
    """(pyarrow filesystem, base path) of a storage root; built once per process (an S3 client resolves
    credentials and region when it is made)."""
    from pyarrow import fs

    try:
        return fs.FileSystem.from_uri(root)
    except Exception as exc:
        raise StorageError(f"train.storage {root!r}: cannot open it ({' '.join(str(exc).split())}); check the "
                           "URI and, for object stores, the credentials") from None


@dataclass(frozen=True)
class Location:
    """A directory in URI storage: `root` (the `train.storage` value) and a `/`-separated `key` below it.
    Behaves like a path where the coordinator needs one: `loc / "agents"`, `loc.name`, `str(loc)` (the URI)."""

    root: str
    key: str = ""

    @classmethod
    def parse(cls, uri: str) -> Location:
        return cls(uri.rstrip("/"))

    def __truediv__(self, part: str) -> Location:
        return Location(self.root, f"{self.key}/{part}".strip("/"))

    @property
    def name(self) -> str:
        return (self.key or self.root.rstrip("/")).rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        return Location(self.root, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def __str__(self) -> str:
        return f"{self.root.rstrip('/')}/{self.key}" if self.key else self.root

    @property
    def fs(self):
        return _filesystem(self.root)[0]

    @property
    def path(self) -> str:
        """This location's path inside its filesystem."""
        base = _filesystem(self.root)[1].rstrip("/")
        return f"{base}/{self.key}" if self.key else base


# -------------------------------------------------------------------------- files in URI storage
def read_bytes(loc: Location) -> bytes:
    with loc.fs.open_input_stream(loc.path) as f:
        return f.read()


def write_bytes(loc: Location, data: bytes) -> None:
    _make_parent(loc)
    with loc.fs.open_output_stream(loc.path) as f:
        f.write(data)


def exists(loc: Location) -> bool:
    from pyarrow import fs

    return loc.fs.get_file_info(loc.path).type != fs.FileType.NotFound


def file_sizes(loc: Location) -> dict[str, int]:
    """Every file below `loc` (relative `/`-separated name -> size in bytes); empty if there is none."""
    from pyarrow import fs

    try:
        infos = loc.fs.get_file_info(fs.FileSelector(loc.path, recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return {}
    base = loc.path.rstrip("/") + "/"
    return {i.path[len(base):]: i.size for i in infos if i.type == fs.FileType.File and i.path.startswith(base)}


def subdirectories(loc: Location) -> list[str]:
    """Names of the directories (prefixes) directly below `loc`."""
    from pyarrow import fs

    try:
        infos = loc.fs.get_file_info(fs.FileSelector(loc.path, recursive=False, allow_not_found=True))
    except FileNotFoundError:
        return []
    return [i.base_name for i in infos if i.type == fs.FileType.Directory]


def delete(loc: Location, *, first: str | None = None) -> None:
    """Delete everything below `loc` (nothing if absent); `first`, a file name in it, goes before the rest
    (a checkpoint's commit record, so that a deletion cut short never leaves a listed, partial checkpoint)."""
    from pyarrow import fs

    if first is not None:
        try:
            loc.fs.delete_file((loc / first).path)
        except (FileNotFoundError, OSError):
            pass
    if loc.fs.get_file_info(loc.path).type != fs.FileType.NotFound:
        loc.fs.delete_dir(loc.path)


def make_dirs(loc: Location) -> None:
    loc.fs.create_dir(loc.path, recursive=True)


def _make_parent(loc: Location) -> None:
    if loc.key and "/" in loc.key:  # object stores have no directories; a local filesystem needs them
        loc.fs.create_dir(loc.parent.path, recursive=True)


def upload(local: Path, dest: Location) -> dict[str, tuple[str, int]]:
    """Stream every file under `local` to `dest`, hashing as it goes: relative name -> (sha256, size)."""
    files = {}
    made = set()
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        name = path.relative_to(local).as_posix()
        target = dest / name
        if target.parent.key not in made:
            _make_parent(target)
            made.add(target.parent.key)
        digest, size = hashlib.sha256(), 0
        with open(path, "rb") as src, dest.fs.open_output_stream(target.path) as out:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        files[name] = (digest.hexdigest(), size)
    return files


def download(src: Location, files: dict[str, str], local: Path) -> str | None:
    """Stream the `files` (relative name -> sha256) under `src` into `local`, hashing as it goes; why the
    copy cannot be trusted (a missing file, or one that does not match its checksum), or None."""
    for name, expected in sorted(files.items()):
        target = local / name
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        try:
            with src.fs.open_input_stream((src / name).path) as f, open(target, "wb") as out:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
        except FileNotFoundError:
            return f"{name} is missing"
        if digest.hexdigest() != expected:
            return f"{name} does not match its checksum"
    return None


def hash_tree(local: Path) -> dict[str, tuple[str, int]]:
    """relative name -> (sha256, size) of every file under `local`."""
    files = {}
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        files[path.relative_to(local).as_posix()] = (sha256(path), path.stat().st_size)
    return files


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------- node-local staging
@contextmanager
def staging() -> Iterator[Path]:
    """A fresh directory under this node's TMPDIR, removed afterwards; staging directories left by dead
    processes on this node (a trainer killed mid-upload) are removed first."""
    sweep_staging()
    path = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sweep_staging() -> list[Path]:
    """Remove this node's staging directories whose process is gone; the ones removed."""
    removed = []
    for path in Path(tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*"):
        pid = path.name[len(STAGING_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------ what runs in a trainer's process
@dataclass(frozen=True)
class SaveRequest:
    """Save the agent's checkpoint files at `target` (its directory of the checkpoint being written)."""

    target: Path | Location


@dataclass(frozen=True)
class LoadRequest:
    """Load the agent from its checkpoint files at `source`; `files` (name -> sha256) checks a copy from storage."""

    source: Path | Location
    files: dict[str, str] | None = None


@dataclass(frozen=True)
class ProbeRequest:
    """Whether this node sees the probe file `token` at `where`; the answer is written beside it for `agent`."""

    where: Path | Location
    token: str
    agent: str


def save(trainer: Any, *, target: Path | Location) -> StoredFiles:
    """Save `trainer` (its `save(path)`) at `target` and report every file it wrote with checksum and size.
    A Path is a directory the coordinator made in the shared run directory: written in place. A Location: staged on this node, uploaded, unstaged."""
    if isinstance(target, Path):
        if not target.is_dir():  # the coordinator made it: a node that does not see it does not share the directory
            raise StorageError(f"{target} (made by the coordinator) is not on this node, so the run directory "
                               "is not shared with it; set train.storage to a URI every node reaches")
        trainer.save(target)
        files = hash_tree(target)
    else:
        with staging() as local:
            trainer.save(local)
            files = upload(local, target)
    return StoredFiles(files={name: digest for name, (digest, _) in files.items()},
                       sizes={name: size for name, (_, size) in files.items()})


def load(trainer: Any, *, source: Path | Location, files: dict[str, str] | None = None) -> str | None:
    """Load `trainer` from the checkpoint files at `source`. A Location is downloaded to this node first and
    every file checked against `files` (name -> sha256); returns why that copy is damaged (nothing is
    loaded then), else None."""
    if isinstance(source, Path):
        trainer.load(source)
        return None
    with staging() as local:
        problem = download(source, files or {}, local)
        if problem is None:
            trainer.load(local)
    return problem


def probe(trainer: Any, *, where: Path | Location, token: str, agent: str) -> bool:
    """Whether this node sees the probe file the coordinator wrote at `where`; if so, write this agent's
    answer beside it (so that writing is checked too). Nothing is written where the probe is not seen."""
    mine = f"{PROBE_PREFIX}{token}-{agent}"
    if isinstance(where, Path):
        try:
            seen = (where / f"{PROBE_PREFIX}{token}").read_text() == token
        except OSError:
            return False
        if seen:
            (where / mine).write_text(token)
        return seen
    try:
        seen = read_bytes(where / f"{PROBE_PREFIX}{token}").decode() == token
    except OSError:
        return False
    if seen:
        write_bytes(where / mine, token.encode())
    return seen
