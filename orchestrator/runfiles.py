"""Files of a run directory that may come from someone else, and a file the user names to write.

A run directory received from another person (a tarball, a shared folder) is read only through `open_inside`: a
regular file inside it, reached without following a link at any step, so that a `source/secret` pointing at
`~/.aws/credentials` or a `transcripts.jsonl` pointing at another user's records is never read (and a FIFO never
blocks the reader). What is passed over is listed by `skipped`.

`write_output` writes a report where `--out` says, whole (beside, then renamed over), and refuses in one line to
replace what is not a report marsi wrote (a run's `config.yaml`, any other file, a link, a directory) unless
`--force` is given.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path
from typing import IO, Any, Iterator

from orchestrator.runlog import read_jsonl
from protocols.errors import UserError

REPORT_HEAD = b'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>marsi report: '
"""How every report `marsi report` writes begins (orchestrator/report.py's PAGE): a file that begins so may be
written over."""


class OutputError(UserError, ValueError):
    """`--out` names a place the report must not go (or cannot)."""


@contextlib.contextmanager
def open_inside(run_dir: Path, name: str) -> Iterator[IO[bytes] | None]:
    """The file `name` (`/`-separated, relative) of `run_dir`, open for reading, if it is a regular file reached
    without a link (each folder on the way opened with O_NOFOLLOW, from the one before); else None."""
    parts = name.split("/")
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield None
        return
    try:
        for part in parts[:-1]:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        inner = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    except OSError:
        os.close(fd)
        yield None
        return
    os.close(fd)
    f = os.fdopen(inner, "rb")
    with f:
        yield f if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None


def read_text(run_dir: Path, name: str) -> str | None:
    """The text of a regular file inside `run_dir` (see `open_inside`), or None."""
    with open_inside(run_dir, name) as f:
        return None if f is None else f.read().decode(errors="replace")


def read_records(run_dir: Path, name: str) -> list[dict[str, Any]]:
    """The rows of a JSON-lines record inside `run_dir` (`runlog.read_jsonl`); [] if it is not a regular file there."""
    with open_inside(run_dir, name) as f:
        return [] if f is None else read_jsonl(run_dir / name, io.TextIOWrapper(f))


def listing(run_dir: Path, folder: str) -> list[str]:
    """Names in `run_dir`/`folder` (a real folder inside it, not a link), sorted; [] if there is none."""
    folder_path = run_dir / folder
    if folder_path.is_symlink() or not folder_path.is_dir():
        return []
    return sorted(p.name for p in folder_path.iterdir())


def skipped(run_dir: Path, names: list[str]) -> list[str]:
    """Which of `names` exist in `run_dir` (as a link too) but are not regular files inside it, each with why."""
    out = []
    for name in names:
        path = run_dir / name
        if not os.path.lexists(path):
            continue
        with open_inside(run_dir, name) as f:
            if f is not None:
                continue
        kind = "a link" if any((run_dir / "/".join(name.split("/")[:i + 1])).is_symlink()
                               for i in range(name.count("/") + 1)) else "not a regular file"
        out.append(f"{name} ({kind})")
    return out


def check_output(out: Path, *, force: bool) -> None:
    """Refuse (OutputError) an `out` that is a directory, or an existing file (a link too) that is not a report marsi
    wrote, unless `force`."""
    if out.is_dir() and not out.is_symlink():
        raise OutputError(f"--out {out}: a directory; give the report's file, e.g. --out {out / 'report.html'}")
    if os.path.lexists(out) and not force and not _is_report(out):
        raise OutputError(f"--out {out}: exists and is not a report marsi wrote (a run's record, or another file); "
                          "give another path, or add --force to replace it")


def write_output(out: Path, text: str, *, force: bool) -> Path:
    """Write `text` to `out` (a report), beside it first and then renamed over it, so that a link there is replaced,
    never followed; refused as `check_output` says, or when its folder cannot be made or written (OutputError,
    nothing written)."""
    check_output(out, force=force)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, out)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OutputError(f"--out {out}: cannot write it ({exc.strerror or exc}); give a path in a folder you can "
                          "write, e.g. --out report.html") from None
    return out


def _is_report(path: Path) -> bool:
    """Whether `path` is a regular file (not a link) that begins as marsi's reports do."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        return stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read(len(REPORT_HEAD)) == REPORT_HEAD
