"""What every section of the run config shares: strict models (unknown keys refused, field docstrings in
`help()`), and `ConfigError`, the one-line user error a bad config raises."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from protocols.errors import UserError


class ConfigError(UserError, ValueError):
    """A user error in a run config; its message is one line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.__doc__ = with_field_docs(cls)


def with_field_docs(model: type[BaseModel]) -> str:
    """The model's docstring followed by one line per field and its own docstring, so help() shows them."""
    lines = [f"    {name}: {field.description}" for name, field in model.model_fields.items() if field.description]
    head = (model.__doc__ or model.__name__).rstrip()
    return head + ("\n\nFields:\n" + "\n".join(lines) if lines else "")


def unknown_agent(key: str, names: list[str], agents: dict[str, Any]) -> str | None:
    """Why `key`, which lists `names`, names an agent that `agents` (the run's) does not define, or None."""
    for name in names:
        if name not in agents:
            return f"{key}: agent {name!r} is not defined; defined agents: {', '.join(agents)}"
    return None
