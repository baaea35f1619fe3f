"""The base of every error caused by the user's input (config, files, environment, model path), and how messages
name it."""

from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path


class UserError(Exception):
    """Bad input, not a bug in marsi: the CLI prints its one-line message and exits with status 2."""


def one_line(exc: BaseException) -> str:
    """The exception's message with every run of whitespace (newlines too) folded to one space."""
    return " ".join(str(exc).split())


def describe(exc: BaseException) -> str:
    """`Type: message` on one line."""
    return f"{type(exc).__name__}: {one_line(exc)}"


_NOT_USER_CODE = [str(Path(__file__).resolve().parents[1] / package) for package in ("protocols", "orchestrator",
                                                                                     "agent_trainer")]


def user_line(exc: BaseException) -> str | None:
    """`file:line` of the innermost frame of `exc`'s traceback in the user's code (not marsi's, the standard
    library's or an installed package's), relative to the working directory when inside it; None if none is."""
    found = None
    for frame, line in traceback.walk_tb(exc.__traceback__):
        path = Path(frame.f_code.co_filename)
        if path.is_file() and not _installed(path.resolve()):
            found = (path, line)
    if found is None:
        return None
    path, line = found
    with contextlib.suppress(ValueError):
        path = path.resolve().relative_to(Path.cwd())
    return f"{path}:{line}"


def _installed(path: Path) -> bool:
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return True
    return any(path.is_relative_to(root) for root in (*_NOT_USER_CODE, sys.base_prefix, sys.prefix))
