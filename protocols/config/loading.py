"""Reading a run config: YAML (strictly: no key twice, no alias bombs), dotted overrides, validation, paths made
absolute; every problem one `ConfigError` line naming the file, the dotted key, the bad value and the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from protocols.config.base import ConfigError
from protocols.config.cluster import joins_cluster
from protocols.config.run import RunConfig
from protocols.imports import ImportPathError, absolute_spec, import_object
from protocols.local_checks import forward_env_problem, model_source


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides (values parsed as YAML) onto a nested dict, in place."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. train.steps=5")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} holds a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    loc = [str(p) for p in error["loc"]]
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        parent = _model_at(model, error["loc"][:-1])
        allowed = ", ".join(parent.model_fields) if parent else "see `marsi schema`"
        return f"{key}: unknown key; allowed keys here: {allowed}"
    msg = error["msg"].removeprefix("Value error, ")
    if not loc or msg.startswith((f"{key}: ", f"{key}.")):  # a cross-field check that names its own keys
        return msg
    if error["type"] == "missing":
        return f"{key}: missing; this key is required (see `marsi schema`)"
    return f"{key}: {msg} (got {error.get('input')!r})"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that sits at `loc` inside `model`, if any."""
    current: Any = model
    dict_key = False
    for part in loc:
        if isinstance(part, int) or current is None or dict_key:
            dict_key = False
            continue
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
            current = field.annotation if field else None
        else:
            current = None
        dict_key = get_origin(current) is dict
        if current is not None and hasattr(current, "__args__"):  # dict[str, Model], list[...], Optional
            current = next((a for a in current.__args__ if isinstance(a, type) and issubclass(a, BaseModel)), current)
        if hasattr(current, "__args__"):
            current = None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


_MAX_VALUES = 100_000  # a config this large after alias expansion is an attack (a "billion laughs"), not a run


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the later one would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<" and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (each key may appear once; the later one would win)",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _expanded_size(value: Any, budget: int) -> int:
    """Values in `value` with every shared (aliased) node counted each time it appears; stops past `budget`."""
    count, stack = 0, [value]
    while stack and count <= budget:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count


def load_config(path: str | Path, overrides: list[str] | None = None, *, check_imports: bool = True) -> RunConfig:
    """Read, override and validate a run config; any problem raises a one-line `ConfigError`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.strerror}); check the path") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); "
                          "save the file as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{where}: malformed YAML: {problem}; fix the syntax there") from None
    if _expanded_size(raw, _MAX_VALUES) > _MAX_VALUES:
        raise ConfigError(f"{path}: expands to more than {_MAX_VALUES:,} values through YAML aliases (*name); "
                          "write the values out, or use fewer nested aliases")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (agents, environment, ...), got {type(raw).__name__}")
    try:
        apply_overrides(raw, overrides or [])
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return validate_config(raw, source=path, check_imports=check_imports)


def _model_source(key: str, value: str, base: Path, source: str | Path, check: bool) -> str:
    resolved, problem = model_source(key, value, base, check=check)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    return resolved


def validate_config(raw: dict[str, Any], *, source: str | Path = "<config>", check_imports: bool = True) -> RunConfig:
    """Validate a config mapping; `source` names it in errors and anchors relative paths."""
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"{source}: {_describe(errors[0], RunConfig)}{more}") from None
    # Paths relative to the config file become absolute (and ~ is expanded), so the resolved config stands alone.
    base = Path(source).resolve().parent if str(source) != "<config>" else Path.cwd()
    config.environment.name = absolute_spec(config.environment.name, base)
    for key, data in (("data", config.data), ("eval.data", config.eval.data if config.eval else None)):
        if data is None:
            continue
        if data.factory is not None:
            data.factory = absolute_spec(data.factory, base)
        if data.path is not None:
            data.path = str((base / Path(data.path).expanduser()).resolve())
        if check_imports and data.path is not None and not Path(data.path).exists():
            raise ConfigError(f"{source}: {key}.path: file {data.path!r} not found; fix the path")
        if check_imports and data.factory is not None:
            try:
                import_object(data.factory)
            except ImportPathError as exc:
                raise ConfigError(f"{source}: {key}.factory: {exc}") from None
    for label, held in (config.eval.partners if config.eval else {}).items():
        for agent, source_weights in held.items():
            if source_weights not in ("initial", "scripted"):
                local = (base / Path(source_weights).expanduser()).resolve()
                if check_imports and not local.is_dir():
                    raise ConfigError(f"{source}: eval.partners.{label}.{agent}: {str(local)!r} is not a directory; give "
                                      "initial, scripted, or a checkpoint or model directory")
                held[agent] = str(local)
    if config.train.storage is not None and "://" not in config.train.storage:
        config.train.storage = str((base / Path(config.train.storage).expanduser()).resolve())
    on_cluster = joins_cluster(config.ray)
    problem = forward_env_problem(config.ray.forward_env) if check_imports else None
    if problem:
        raise ConfigError(f"{source}: {problem}")
    check_models = check_imports and not on_cluster  # on a cluster: checked on the node that hosts each agent
    for name, agent in config.agents.items():
        for key in ("model", "tokenizer"):
            value = getattr(agent, key)
            if value is not None:
                setattr(agent, key, _model_source(f"agents.{name}.{key}", value, base, source, check_models))
        adapter = agent.adapter
        if adapter is not None and adapter.path is not None:
            local = (base / Path(adapter.path).expanduser()).resolve()
            if check_imports and not (local / "adapter_config.json").is_file() and not on_cluster:
                raise ConfigError(f"{source}: agents.{name}.adapter.path: {str(local)!r} holds no adapter_config.json; "
                                  "give a saved adapter's directory (a checkpoint's agents/NAME/adapter)")
            adapter.path = str(local)
            if config.algorithm.beta > 0 and name not in config.schedule.frozen:
                raise ConfigError(f"{source}: agents.{name}.adapter.path: a trainable adapter agent's KL reference is its "
                                  f"base with adapters off, not the saved adapter it starts from, so algorithm.beta "
                                  f"{config.algorithm.beta:g} would pull it back to the base; set algorithm.beta: 0, or "
                                  "freeze it (schedule.frozen), or start from a fresh adapter")
    if config.critic is not None and config.critic.model != "agent":
        config.critic.model = _model_source("critic.model", config.critic.model, base, source, check_models)
    if check_imports:
        try:
            import_object(config.environment.name)
        except ImportPathError as exc:
            raise ConfigError(f"{source}: environment.name: {exc}") from None
    return config
