"""The checkpoint store: where checkpoints live, and how a trainer puts its files there and gets them back.

Every place in it is a `Location` (`protocols/messages.py`): a filesystem URI and a key below it, reached
through `pyarrow.fs`, the filesystem layer Ray's own storage uses. `train.storage` chooses the store:

- **The run directory** (default): `RUN_DIR/checkpoints`, a `file://` location (written as its absolute
  path). Every node that hosts a trainer must see it (one machine, or a filesystem all nodes share).
- **A filesystem URI**: `s3://`, `gs://`, `hdfs://`, `file://`, or an absolute path on a shared filesystem
  such as NFS.

One code path serves both; the coordinator checks at start that every trainer's node reaches the store
(`probe`). A trainer writes its checkpoint files and reports their checksums and sizes: on a filesystem
this node mounts (`on_disk`: the run directory, `file://`, NFS) in place; on any other (an object store)
into a node-local staging directory (under the node's TMPDIR), uploaded, then removed. A load checks
every file against the checkpoint's manifest on the trainer's node (in place, or as it is downloaded into
staging) before anything is loaded. Nothing passes through the coordinator, and no file is ever held
whole in memory.

The functions `save`, `load` and `probe` run in a trainer's process (Ray actor or in-process): the agent's
handle methods of those names (`agent_trainer.agent.Agent`) call them with the typed requests of
`protocols/messages.py`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from protocols.errors import UserError
from protocols.messages import Location, StoredFiles

__all__ = ["Location", "StorageError", "StorageTimeout", "save", "load", "probe", "within"]

CHUNK = 8 << 20  # bytes read or written at a time: a file is streamed, never held whole
STAGING_PREFIX = "marsi-ckpt-"  # node-local staging directories: marsi-ckpt-<pid>-<random>
PROBE_PREFIX = ".marsi-probe-"


class StorageError(UserError, RuntimeError):
    """Checkpoint storage is unusable as configured (not shared by every node, unreachable, ...)."""


class StorageTimeout(StorageError):
    """A call to the store did not answer within its deadline (`within`)."""


def within(seconds: float | None, what: str, fn, *args):
    """`fn(*args)`, run in a thread of its own and given up after `seconds` (StorageTimeout naming `what`; None waits
    forever): the deadline of one call to the store, which a `Location` carries (`train.storage_timeout_s`). The call
    may go on in the background, where it harms nothing (no file is committed by it alone)."""
    if seconds is None:
        return fn(*args)
    outcome: dict[str, Any] = {}

    def call():
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller below
            outcome["error"] = exc

    worker = threading.Thread(target=call, name="marsi-storage-call", daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise StorageTimeout(f"storage: {what} did not answer within {seconds:g} s (train.storage_timeout_s); "
                             "check that this machine reaches the store (network, URI, credentials), or raise "
                             "train.storage_timeout_s for a slow one")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class _Stream:
    """A file stream of the store whose every read, write and close keeps the deadline."""

    def __init__(self, raw, what: str, seconds: float | None):
        self.raw, self.what, self.seconds = raw, what, seconds

    def read(self, size: int = -1) -> bytes:
        args = (size,) if size >= 0 else ()
        return within(self.seconds, f"reading {self.what}", self.raw.read, *args)

    def write(self, data: bytes) -> None:
        within(self.seconds, f"writing {self.what}", self.raw.write, data)

    def close(self) -> None:
        within(self.seconds, f"closing {self.what}", self.raw.close)

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Filesystem:
    """A pyarrow filesystem whose every call keeps the deadline `seconds`; messages name the place (`root` + path)."""

    def __init__(self, raw, root: str, seconds: float | None):
        self.raw, self.root, self.seconds = raw, root, seconds

    def _within(self, what: str, fn, *args):
        return within(self.seconds, what, fn, *args)

    def where(self, path: str) -> str:
        return path if isinstance(self.raw, _local_fs()) else f"{self.root.split('://', 1)[0]}://{path.lstrip('/')}"

    def get_file_info(self, target):
        from pyarrow import fs

        path = target.base_dir if isinstance(target, fs.FileSelector) else target
        return self._within(f"listing {self.where(path)}", self.raw.get_file_info, target)

    def open_input_stream(self, path: str) -> _Stream:
        return _Stream(self._within(f"opening {self.where(path)}", self.raw.open_input_stream, path), self.where(path),
                       self.seconds)

    def open_output_stream(self, path: str) -> _Stream:
        return _Stream(self._within(f"creating {self.where(path)}", self.raw.open_output_stream, path),
                       self.where(path), self.seconds)

    def move(self, src: str, dest: str) -> None:
        self._within(f"moving {self.where(src)} to {self.where(dest)}", self.raw.move, src, dest)

    def delete_file(self, path: str) -> None:
        self._within(f"deleting {self.where(path)}", self.raw.delete_file, path)

    def delete_dir(self, path: str) -> None:
        self._within(f"deleting {self.where(path)}", self.raw.delete_dir, path)

    def create_dir(self, path: str, recursive: bool = True) -> None:
        self._within(f"creating {self.where(path)}", functools.partial(self.raw.create_dir, path, recursive=recursive))


def _local_fs():
    from pyarrow import fs

    return fs.LocalFileSystem


@functools.lru_cache(maxsize=16)
def _filesystem(root: str, seconds: float | None):
    """(pyarrow filesystem, base path) of a storage root; built once per process (an S3 client resolves credentials
    and region when it is made), within the deadline."""
    from pyarrow import fs

    try:
        return within(seconds, f"opening {root}", fs.FileSystem.from_uri, root)
    except StorageError:
        raise
    except Exception as exc:
        raise StorageError(f"train.storage {root!r}: cannot open it ({' '.join(str(exc).split())}); check the "
                           "URI and, for object stores, the credentials") from None


def _fs(loc: Location):
    """(filesystem keeping `loc`'s deadline, this location's path inside it)."""
    raw, base = _filesystem(loc.root, loc.deadline_s)
    base = base.rstrip("/")
    return _Filesystem(raw, loc.root, loc.deadline_s), f"{base}/{loc.key}" if loc.key else (base or "/")


def on_disk(loc: Location) -> Path | None:
    """`loc` as a path on this node's disk when its filesystem is one this node mounts (written and read in
    place), else None (an object store: files are staged on this node)."""
    filesystem, path = _fs(loc)
    return Path(path) if isinstance(filesystem.raw, _local_fs()) else None


# ------------------------------------------------------------------------------ files in the store
def read_bytes(loc: Location) -> bytes:
    filesystem, path = _fs(loc)
    with filesystem.open_input_stream(path) as f:
        return f.read()


def write_bytes(loc: Location, data: bytes) -> None:
    filesystem, path = _fs(loc)
    _make_parent(loc)
    with filesystem.open_output_stream(path) as f:
        f.write(data)


def commit_bytes(loc: Location, data: bytes) -> None:
    """Write `data` at `loc` so that it is there whole or not at all: written beside it under a temporary
    name, then moved over it (a rename on a filesystem; an object store's copy is whole too)."""
    filesystem, path = _fs(loc)
    tmp = loc.parent / f".{loc.name}.tmp"
    write_bytes(tmp, data)
    filesystem.move(_fs(tmp)[1], path)


def exists(loc: Location) -> bool:
    from pyarrow import fs

    filesystem, path = _fs(loc)
    return filesystem.get_file_info(path).type != fs.FileType.NotFound


def file_sizes(loc: Location) -> dict[str, int]:
    """Every file below `loc` (relative `/`-separated name -> size in bytes); empty if there is none."""
    from pyarrow import fs

    filesystem, path = _fs(loc)
    try:
        infos = filesystem.get_file_info(fs.FileSelector(path, recursive=True, allow_not_found=True))
    except FileNotFoundError:
        return {}
    base = path.rstrip("/") + "/"
    return {i.path[len(base):]: i.size for i in infos if i.type == fs.FileType.File and i.path.startswith(base)}


def subdirectories(loc: Location) -> list[str]:
    """Names of the directories (prefixes) directly below `loc`."""
    from pyarrow import fs

    filesystem, path = _fs(loc)
    try:
        infos = filesystem.get_file_info(fs.FileSelector(path, recursive=False, allow_not_found=True))
    except FileNotFoundError:
        return []
    return [i.base_name for i in infos if i.type == fs.FileType.Directory]


def delete_file(loc: Location) -> None:
    """Delete the file at `loc` (nothing if absent)."""
    filesystem, path = _fs(loc)
    try:
        filesystem.delete_file(path)
    except FileNotFoundError:
        pass


def delete(loc: Location, *, first: str | None = None) -> None:
    """Delete everything below `loc` (nothing if absent); `first`, a file name in it, goes before the rest
    (a checkpoint's commit record, so that a deletion cut short never leaves a listed, partial checkpoint)."""
    if first is not None:
        try:
            delete_file(loc / first)
        except OSError:
            pass
    if exists(loc):
        filesystem, path = _fs(loc)
        filesystem.delete_dir(path)


def make_dirs(loc: Location) -> None:
    filesystem, path = _fs(loc)
    filesystem.create_dir(path, recursive=True)


def _make_parent(loc: Location) -> None:
    if loc.key and "/" in loc.key:  # object stores have no directories; a local filesystem needs them
        make_dirs(loc.parent)


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
        files[name] = upload_file(path, target, make_parent=False)
    return files


def upload_file(path: Path, target: Location, *, make_parent: bool = True) -> tuple[str, int]:
    """Stream the file at `path` to `target`, hashing as it goes: (sha256, size)."""
    if make_parent:
        _make_parent(target)
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as src, _fs(target)[0].open_output_stream(_fs(target)[1]) as out:
        while chunk := src.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def upload_part(path: Path, offset: int, size: int, target: Location) -> None:
    """Stream bytes [offset, offset + size) of the file at `path` to `target`."""
    _make_parent(target)
    with open(path, "rb") as src, _fs(target)[0].open_output_stream(_fs(target)[1]) as out:
        src.seek(offset)
        while size > 0 and (chunk := src.read(min(CHUNK, size))):
            out.write(chunk)
            size -= len(chunk)


def hash_part(f, size: int) -> tuple[str, int]:
    """(sha256, bytes read) of the next `size` bytes (at most) of the open file `f`, read a chunk at a time."""
    digest, done = hashlib.sha256(), 0
    while done < size and (chunk := f.read(min(CHUNK, size - done))):
        digest.update(chunk)
        done += len(chunk)
    return digest.hexdigest(), done


def append_to(src: Location, out) -> tuple[str, int]:
    """Stream the file at `src` onto the open file `out`, hashing as it goes: (sha256, size)."""
    digest, size = hashlib.sha256(), 0
    with _fs(src)[0].open_input_stream(_fs(src)[1]) as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def download(src: Location, files: dict[str, str | None], local: Path) -> str | None:
    """Stream the `files` (relative name -> sha256, None: unchecked) under `src` into `local`, hashing as it
    goes; why the copy cannot be trusted (a missing file, or one that does not match its checksum), or None."""
    filesystem = _fs(src)[0]
    for name, expected in sorted(files.items()):
        target = local / name
        target.parent.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256()
        try:
            with filesystem.open_input_stream(_fs(src / name)[1]) as f, open(target, "wb") as out:
                while chunk := f.read(CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
        except FileNotFoundError:
            return f"{name} is missing"
        if expected is not None and digest.hexdigest() != expected:
            return f"{name} does not match its checksum"
    return None


def check_tree(local: Path, files: dict[str, str]) -> str | None:
    """Why the `files` (relative name -> sha256) under `local` cannot be trusted (one missing, or one that
    does not match its checksum), or None."""
    for name, expected in sorted(files.items()):
        path = local / name
        if not path.is_file():
            return f"{name} is missing"
        if sha256(path) != expected:
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
def save(trainer: Any, *, target: Location) -> StoredFiles:
    """Save `trainer` (its `save(path)`) at `target` and report every file it wrote with checksum and size:
    in place where this node mounts the store, else staged on this node, uploaded and unstaged."""
    place = on_disk(target)
    if place is not None:
        place.mkdir(parents=True, exist_ok=True)
        trainer.save(place)
        files = hash_tree(place)
    else:
        with staging() as local:
            trainer.save(local)
            files = upload(local, target)
    return StoredFiles(files={name: digest for name, (digest, _) in files.items()},
                       sizes={name: size for name, (_, size) in files.items()})


def load(trainer: Any, *, source: Location, files: dict[str, str] | None = None) -> str | None:
    """Load `trainer` from the checkpoint files at `source`, each checked first against `files` (name ->
    sha256; None: a directory given by hand, loaded as it is), in place or as it is downloaded to this node;
    returns why the checkpoint is damaged (nothing is loaded then), else None."""
    place = on_disk(source)
    if place is not None:
        problem = check_tree(place, files) if files is not None else None
        if problem is None:
            trainer.load(place, checkpoint=str(source))
        return problem
    with staging() as local:
        wanted = files if files is not None else dict.fromkeys(file_sizes(source))
        problem = download(source, wanted, local)
        if problem is None:
            trainer.load(local, checkpoint=str(source))
    return problem


def probe(*, where: Location, token: str, agent: str) -> bool:
    """Whether this node sees the probe file the coordinator wrote at `where`; if so, write this agent's
    answer beside it (so that writing is checked too). Nothing is written where the probe is not seen. A store
    this node cannot reach at all (no route, no credentials, a call past its deadline) raises StorageError with
    the reason."""
    try:
        seen = read_bytes(where / f"{PROBE_PREFIX}{token}") == token.encode()
    except FileNotFoundError:
        return False  # reached, but not the same storage (a path this node has on its own disk)
    except StorageError:
        raise
    except OSError as exc:
        raise StorageError(" ".join(str(exc).split()) or type(exc).__name__) from None
    if seen:
        write_bytes(where / f"{PROBE_PREFIX}{token}-{agent}", token.encode())
    return seen
