"""Checks of a run config against this machine, made where it is loaded for a run (`validate_config` with
`check_imports`), so that they fail before anything starts: a model path that does not exist, a hub model that
cannot load here offline, `ray.forward_env` names that this shell does not set."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

BUILTIN_NAMES = "builtin:tiny, builtin:smollm2-135m-instruct"
_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's reading of a boolean variable


def offline_variable(environ: Mapping[str, str] | None = None) -> str | None:
    """The variable that keeps the Hugging Face hub offline here (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE), or None."""
    environ = os.environ if environ is None else environ
    return next((v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if environ.get(v, "").upper() in _TRUE), None)


def local_path(value: str, base: Path) -> Path | None:
    """The absolute path `value` names if it is a local path (relative to `base`), or None (a hub id, a built-in).
    `./x`, `../x`, `~/x` and `/x` are paths; `org/name` is a path only if it exists under `base`."""
    if value.startswith("builtin:"):
        return None
    path = Path(value).expanduser()
    if value.startswith(("./", "../", "~", "/")) or (base / path).exists():
        return (base / path).resolve()
    return None


def model_source(key: str, value: str, base: Path, *, check: bool) -> tuple[str, str | None]:
    """A model (or tokenizer) setting at `key`, made absolute when it is a local path, and with `check` why it
    cannot load here (a path that does not exist; a hub id not in the local cache while offline), or None."""
    local = local_path(value, base)
    if local is not None:
        missing = check and not local.exists()
        return str(local), (f"{key}: {str(local)!r} not found; give an existing directory (relative to the config "
                            "file), a hub id, or a built-in") if missing else None
    hub_id = not value.startswith("builtin:") and not Path(value).expanduser().exists()  # not a path from here either
    marker = "tokenizer_config.json" if key.endswith("tokenizer") else "config.json"
    return value, hub_model_problem(key, value, marker) if check and hub_id else None


def hub_model_problem(key: str, value: str, marker: str = "config.json") -> str | None:
    """Why the hub id `value` (at `key`) cannot load here: the hub is offline and its `marker` file is not in the
    local Hugging Face cache; or None (online, the hub is asked when the model loads)."""
    offline = offline_variable()
    if offline is None:
        return None
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(value, marker)
    except HFValidationError:
        found = None
    if isinstance(found, str):
        return None
    return (f"{key}: {value!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {offline} is "
            f"set; download it where there is a network (hf download {value}) and copy that cache here, give a "
            f"local directory, or use a built-in ({BUILTIN_NAMES})")


def forward_env_problem(names: list[str], environ: Mapping[str, str] | None = None) -> str | None:
    """Why `ray.forward_env` cannot forward `names` from this shell: one is not set, or set but empty; or None."""
    environ = os.environ if environ is None else environ
    for name in names:
        if not environ.get(name):
            state = "set but empty" if name in environ else "not set"
            return (f"ray.forward_env: {name} is {state} in the environment of the shell that runs marsi; set it there "
                    f"(export {name}=...) or remove it from ray.forward_env")
    return None


def forward_env_name_problem(name: str) -> str | None:
    """Why `name` is not a variable name `ray.forward_env` can forward, or None (its value is never echoed)."""
    if "=" in name:
        var = name.split("=", 1)[0]
        return (f"ray.forward_env: an entry {var}=... holds a value; forward_env takes variable names only, whose "
                f"values come from the shell that runs marsi: give {var} and set it in that shell, or give a fixed "
                f"value in ray.env_vars ({var}: ...)")
    if not name or not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c == "_" for c in name):
        return f"ray.forward_env: {name!r} is not a variable name; give names of letters, digits and '_', e.g. AWS_REGION"
    return None
