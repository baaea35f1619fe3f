"""Conditional writes of one small object in the store: create it only if absent, replace or delete it only if it
is still the version read. The run's lease (`orchestrator/lease.py`) is the one user; one code path serves every
store, and each backend does it as atomically as it allows:

- **this machine's filesystem** (`file://`, a path, NFS): the object is created with `O_CREAT | O_EXCL`; a read,
  compare and replace (written beside, renamed over it) or delete happens under an exclusive `flock` on a lock
  file beside it (`.NAME.lock`), which NFSv4 carries to its server;
- **S3** (with boto3): S3's conditional requests, `If-None-Match: *` to create, `If-Match: ETAG` to replace or
  delete, so the store itself refuses the loser of a race;
- **any other store** (gs, hdfs, abfs, or S3 without boto3): written, then read back; two writers in the same
  instant may both believe they won, and the lease's check at every commit stops the one that did not.

A version is what `read` returns beside the bytes: S3's ETag, else the bytes' SHA-256."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
from pathlib import Path
from typing import Iterator

from agent_trainer import storage
from protocols.messages import Location


def atomic(loc: Location) -> bool:
    """Whether `create` and `replace` at `loc` are atomic (this machine's filesystem, or S3 with boto3)."""
    return _local(loc) is not None or _s3(loc) is not None


def read(loc: Location) -> tuple[bytes, str] | None:
    """(bytes, version) of the object at `loc`, or None if there is none."""
    client = _s3(loc)
    if client is not None:
        return _s3_read(client, loc)
    try:
        data = storage.read_bytes(loc)
    except FileNotFoundError:
        return None
    return data, _digest(data)


def create(loc: Location, data: bytes) -> bool:
    """Write `data` at `loc` unless something is there already; whether it was written."""
    path = _local(loc)
    if path is not None:
        return storage.within(loc.deadline_s, f"creating {loc}", _local_create, path, data)
    client = _s3(loc)
    if client is not None:
        return _s3_put(client, loc, data, IfNoneMatch="*")
    if storage.exists(loc):
        return False
    storage.write_bytes(loc, data)
    return storage.read_bytes(loc) == data


def replace(loc: Location, data: bytes, version: str) -> bool:
    """Write `data` over the object at `loc` if it is still at `version`; whether it was written."""
    path = _local(loc)
    if path is not None:
        return storage.within(loc.deadline_s, f"writing {loc}", _local_replace, path, data, version)
    client = _s3(loc)
    if client is not None:
        return _s3_put(client, loc, data, IfMatch=version)
    found = read(loc)
    if found is None or found[1] != version:
        return False
    storage.commit_bytes(loc, data)
    return storage.read_bytes(loc) == data


def delete(loc: Location, version: str) -> bool:
    """Delete the object at `loc` if it is still at `version` (and its lock file beside it); whether it was."""
    path = _local(loc)
    if path is not None:
        return storage.within(loc.deadline_s, f"deleting {loc}", _local_delete, path, version)
    client = _s3(loc)
    if client is not None:
        return _s3_delete(client, loc, version)
    return _delete_checked(loc, version)


def _delete_checked(loc: Location, version: str) -> bool:
    found = read(loc)
    if found is None or found[1] != version:
        return False
    storage.delete_file(loc)
    return True


# ------------------------------------------------------------------------------ this machine's filesystem
def _local(loc: Location) -> Path | None:
    """`loc` as a path when its filesystem is this machine's (the filesystem itself, not `storage.on_disk`, which
    tests replace to send trainers through the object-store path)."""
    filesystem, path = storage._fs(loc)
    return Path(path) if isinstance(filesystem.raw, storage._local_fs()) else None


def _local_create(path: Path, data: bytes) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return True


def _local_replace(path: Path, data: bytes, version: str) -> bool:
    with _locked(path):
        if _local_version(path) != version:
            return False
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return True


def _local_delete(path: Path, version: str) -> bool:
    with _locked(path):
        if _local_version(path) != version:
            return False
        path.unlink()
    _lock_file(path).unlink(missing_ok=True)  # nobody needs it once the object is gone
    return True


def _lock_file(path: Path) -> Path:
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on the lock file beside `path` (made if absent)."""
    fd = os.open(_lock_file(path), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def _local_version(path: Path) -> str | None:
    try:
        return _digest(path.read_bytes())
    except FileNotFoundError:
        return None


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------- S3
def _s3(loc: Location):
    """A boto3 S3 client for `loc`'s store, set up as pyarrow's client of it is (endpoint, region; credentials from
    the same places), made once per store client; None for a store that is not S3 or a machine without boto3."""
    from pyarrow import fs

    filesystem, _ = storage._fs(loc)
    if not isinstance(filesystem.raw, fs.S3FileSystem):
        return None
    client = getattr(filesystem, "s3_client", None)
    if client is None:
        try:
            import boto3
        except ImportError:
            return None
        options = filesystem.raw.__reduce__()[1][0]  # what pyarrow resolved: region, scheme, endpoint
        endpoint = options.get("endpoint_override") or None
        if endpoint is not None and "://" not in endpoint:
            endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
        client = filesystem.s3_client = boto3.client("s3", region_name=options.get("region") or None,
                                                     endpoint_url=endpoint)
    return client


def _bucket_key(loc: Location) -> tuple[str, str]:
    _, path = storage._fs(loc)
    bucket, _, key = path.lstrip("/").partition("/")
    return bucket, key


_LOST_RACE = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404", "409", "412")
"""S3's answers to a conditional request whose condition did not hold (or an object gone meanwhile)."""


def _s3_call(loc: Location, what: str, fn, **kwargs):
    """`fn(**kwargs)` within `loc`'s deadline; None when S3 refused it for its condition; any other failure an
    OSError naming `what` (as pyarrow's are), so that callers handle both clients alike."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return storage.within(loc.deadline_s, what, functools.partial(fn, **kwargs))
    except ClientError as exc:
        code = str(exc.response.get("Error", {}).get("Code", ""))
        if code in _LOST_RACE:
            return None
        if code == "NotImplemented":
            raise NotImplementedError(code) from None
        raise OSError(f"{what}: {' '.join(str(exc).split())}") from None
    except BotoCoreError as exc:
        raise OSError(f"{what}: {' '.join(str(exc).split())}") from None


def _s3_read(client, loc: Location) -> tuple[bytes, str] | None:
    bucket, key = _bucket_key(loc)
    reply = _s3_call(loc, f"reading {loc}", client.get_object, Bucket=bucket, Key=key)
    if reply is None:
        return None
    return storage.within(loc.deadline_s, f"reading {loc}", reply["Body"].read), reply["ETag"]


def _s3_put(client, loc: Location, data: bytes, **condition: str) -> bool:
    bucket, key = _bucket_key(loc)
    return _s3_call(loc, f"writing {loc}", client.put_object, Bucket=bucket, Key=key, Body=data, **condition) is not None


def _s3_delete(client, loc: Location, version: str) -> bool:
    bucket, key = _bucket_key(loc)
    try:
        return _s3_call(loc, f"deleting {loc}", client.delete_object, Bucket=bucket, Key=key, IfMatch=version) is not None
    except NotImplementedError:  # a store without conditional deletes
        return _delete_checked(loc, version)
