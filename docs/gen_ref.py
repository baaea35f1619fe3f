"""Pages of the docs site generated from the code at build time (run by mkdocs-gen-files, see mkdocs.yml).

- reference/config.md: every field of the run config, from the pydantic models in protocols/config/
  (dotted key, type, default, docstring, and an example taken from the configs in examples/);
- reference/cli.md: every `marsi` command and argument, from the argument parser in orchestrator/cli.py;
- results.md: benchmarks/RESULTS.md, the one page of measured figures.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.cli import build_parser  # noqa: E402
from protocols.config import RunConfig  # noqa: E402

NAMED = {"agents", "hosts", "eval.partners", "algorithm.agents"}
"""Mappings whose keys the user names: documented as NAME."""


def _type(annotation: Any) -> str:
    """A short, readable spelling of a field's type: `int`, `'a' | 'b'`, `dict[str, AgentConfig]`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _models(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The pydantic model a field holds (directly, optionally, or as dict values) and whether it is a dict."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if origin is dict and len(args) == 2:
        inner, _ = _models(args[1])
        return inner, inner is not None
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            inner, is_dict = _models(arg)
            if inner is not None:
                return inner, is_dict
    return None, False


def _flatten(raw: Any, prefix: str, out: dict[str, list[Any]]) -> None:
    if isinstance(raw, dict):
        for key, value in raw.items():
            if prefix in NAMED:
                key = "NAME"
            path = f"{prefix}.{key}" if prefix else str(key)
            out.setdefault(path, []).append(value)
            _flatten(value, path, out)


def _examples() -> dict[str, list[Any]]:
    """Every dotted key set in the example configs (agent and host names as NAME), with the values given."""
    found: dict[str, list[Any]] = {}
    for path in sorted((REPO / "examples").glob("*/*.yaml")):
        _flatten(yaml.safe_load(path.read_text()), "", found)
    return found


def _value(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value) if not isinstance(value, str) else value


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_reference() -> str:
    examples = _examples()
    lines = ["# Config reference", "",
             "Generated from the pydantic models in `protocols/config/` when the site is built. Every section is",
             "strict: an unknown key is an error. `marsi schema` prints the same as JSON schema; a dotted key is also",
             "an override on the command line (`marsi run CONFIG train.steps=5`). `NAME` stands for a name you choose",
             "(an agent, a host, an evaluation partner). Examples come from the configs in `examples/`; where no",
             "example sets a key, the example shows its default.", ""]

    def section(model: type[BaseModel], prefix: str, title: str) -> None:
        lines.extend([f"## `{prefix}`" if prefix else f"## {title}", ""])
        doc = (model.__doc__ or "").split("\n\nFields:")[0].strip()
        if doc and doc != model.__name__ and not doc.startswith(model.__name__ + "("):
            lines.extend([" ".join(doc.split()), ""])
        lines.extend(["| key | type | default | meaning | example |", "| --- | --- | --- | --- | --- |"])
        nested = []
        for name, field in model.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            if field.default is not PydanticUndefined:
                default = _value(field.default)
            elif field.default_factory is not None:
                default = _value(field.default_factory())
            else:
                default = "required"
            inner, is_dict = _models(field.annotation)
            given = examples.get(path)
            if inner is not None and isinstance(field.default, BaseModel):
                default = "its keys' defaults"
            if inner is not None:
                child = f"{path}.NAME" if is_dict else path
                example = f"see `{child}`"
                nested.append((inner, child))
            elif given:
                example = f"`{name}: {_value(given[0])}`"
            else:
                example = f"`{name}: {default if default != 'required' else '...'}`"
            default = default if default in ("required", "its keys' defaults") else f"`{default}`"
            lines.append(f"| `{name}` | `{_cell(_type(field.annotation))}` | {_cell(default)} | "
                         f"{_cell(field.description or '')} | {_cell(example)} |")
        lines.append("")
        for inner, child in nested:
            section(inner, child, child)

    section(RunConfig, "", "Top level")
    return "\n".join(lines)


def cli_reference() -> str:
    os.environ["COLUMNS"] = "100"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    lines = ["# CLI reference", "",
             "Generated from the argument parser in `orchestrator/cli.py` when the site is built. Errors in input are",
             "one line with exit status 2 ([Errors](../errors.md)); `--debug`, before or after the command, shows the",
             "traceback.", "", "## marsi", "", "```text", parser.format_help().rstrip(), "```", ""]
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, command in sub.choices.items():
        lines.extend([f"## marsi {name}", "", helps.get(name, "") + ".", "",
                      "| argument | default | meaning |", "| --- | --- | --- |"])
        for action in command._actions:
            if action.dest == "help":
                continue
            spelled = ", ".join(action.option_strings) or action.dest
            if action.nargs in ("*", "+"):
                spelled += " ..."
            default = "" if action.default in (None, False, "==SUPPRESS==") else f"`{action.default}`"
            if action.required and action.option_strings:
                default = "required"
            said = command._get_formatter()._expand_help(action) if action.help else ""  # "95%%" as --help prints it
            lines.append(f"| `{spelled}` | {default} | {_cell(said)} |")
        lines.extend(["", "```text", command.format_help().rstrip(), "```", ""])
    return "\n".join(lines)


def results() -> str:
    return (REPO / "benchmarks" / "RESULTS.md").read_text()


PAGES = {"reference/config.md": config_reference, "reference/cli.md": cli_reference, "results.md": results}

if __name__ == "<run_path>":  # mkdocs-gen-files runs this file with runpy.run_path during a build
    import mkdocs_gen_files

    for page, make in PAGES.items():
        with mkdocs_gen_files.open(page, "w") as out:
            out.write(make())
        mkdocs_gen_files.set_edit_path(page, "gen_ref.py")
