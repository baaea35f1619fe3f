"""Resolve `package.module:Name` and `path/to/file.py:Name` import specs."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from protocols.errors import UserError, describe


class ImportPathError(UserError, ImportError):
    """An import spec that does not resolve; its message is one line and says the fix."""


def absolute_spec(spec: str, base_dir: Path) -> str:
    """Make the file part of a `file.py:Name` spec absolute against `base_dir`; module specs pass through."""
    module, sep, name = spec.rpartition(":")
    if sep and module.endswith(".py"):
        return f"{(base_dir / Path(module).expanduser()).resolve()}:{name}"
    return spec


def import_object(spec: str) -> Any:
    """The object named by `module:Name` or `file.py:Name` (an absolute or cwd-relative file)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ImportPathError(f"{spec!r} is not an import path; expected 'package.module:Name' or 'file.py:Name'")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ImportPathError(f"file {str(path)!r} not found; expected 'file.py:Name' relative to the config file")
        key = f"marsi_user_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(key)
        if module is None:
            loaded = importlib.util.spec_from_file_location(key, path)
            module = importlib.util.module_from_spec(loaded)
            sys.modules[key] = module
            try:
                loaded.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[key]
                raise ImportPathError(f"importing {str(path)!r} raised {describe(exc)}") from exc
    else:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise ImportPathError(
                f"cannot import module {module_name!r} ({exc}); expected 'package.module:Name' importable from here"
            ) from None
        except Exception as exc:
            raise ImportPathError(f"importing {module_name!r} raised {describe(exc)}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportPathError(f"module {module_name!r} has no attribute {attr!r}; check the name after ':'") from None
