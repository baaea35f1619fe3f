from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from protocols.config import ConfigError, load_config
from protocols.env import Environment
from protocols.imports import import_object

FIXTURES = (Path(__file__).parent / "fixtures").resolve()
ENV_FILE = FIXTURES / "env_ok.py"
DELETE = object()


def base() -> dict[str, Any]:
    return {
        "agents": {"a": {"model": "builtin:tiny"}, "b": {"model": "builtin:tiny"}},
        "environment": {"name": f"{ENV_FILE}:OkEnv"},
        "roles": {"assignment": {"speaker": "a", "listener": "b"}},
        "data": {"path": str(FIXTURES / "data.jsonl")},
    }


def edit(dotted: str, value: Any = DELETE) -> Callable[[Path], str]:
    """A config maker: the base config with one dotted key set (or deleted)."""

    def make(tmp_path: Path) -> str:
        config = base()
        *parents, last = dotted.split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
        return yaml.safe_dump(config)

    return make


def text(content: str) -> Callable[[Path], str]:
    return lambda tmp_path: content


def no_file(tmp_path: Path) -> None:
    return None


def env_raising_on_import(tmp_path: Path) -> str:
    (tmp_path / "boom.py").write_text("raise RuntimeError('first line\\nsecond line')\n")
    return edit("environment.name", "boom.py:Env")(tmp_path)


def two_errors(tmp_path: Path) -> str:
    config = base()
    config["train"] = {"steps": "many", "batch_size": 0}
    return yaml.safe_dump(config)


BAD = [
    ("malformed_yaml", text("agents:\n  a: {model: x\nroles: []\n"), [], ["3:6: malformed YAML: expected ',' or '}'", "fix the syntax there"]),
    ("not_a_mapping", text("- agents\n- environment\n"), [], ["expected a mapping of sections", "got list"]),
    ("missing_file", no_file, [], ["cannot read config (No such file or directory); check the path"]),
    ("unknown_top_level", edit("trainer", {"steps": 1}), [], ["trainer: unknown key; allowed keys here: agents, environment"]),
    ("unknown_nested", edit("agents.a.optimizer.lrr", 0.1), [], ["agents.a.optimizer.lrr: unknown key; allowed keys here: lr, weight_decay, betas"]),
    ("wrong_type", edit("train.steps", "many"), [], ["train.steps: Input should be a valid integer", "(got 'many')"]),
    ("out_of_range", edit("algorithm.discount", 1.5), [], ["algorithm.discount: Input should be less than or equal to 1", "(got 1.5)"]),
    ("negative", edit("train.batch_size", -1), [], ["train.batch_size: Input should be greater than or equal to 1", "(got -1)"]),
    ("bad_choice", edit("schedule.kind", "random"), [], ["schedule.kind: Input should be 'simultaneous', 'alternate'"]),
    ("two_errors", two_errors, [], ["train.steps: Input should be a valid integer", "(and 1 more)"]),
    ("missing_section", edit("environment"), [], ["environment: missing; this key is required"]),
    ("no_agents", edit("agents", {}), [], ["agents: define at least one agent"]),
    ("roles_unknown_agent", edit("roles.assignment.speaker", "c"), [], ["roles.assignment: agent 'c' is not defined; defined agents: a, b"]),
    ("cycle_other_roles", edit("roles", {"rotation": "per_turn", "cycle": [{"speaker": "a", "listener": "b"}, {"listener": "a"}]}), [],
     ["roles.cycle.1: roles ['listener'] differ from the first seating's ['listener', 'speaker']", "must seat the same roles"]),
    ("cycle_without_rotation", edit("roles", {"cycle": [{"speaker": "a", "listener": "b"}]}), [],
     ["roles.cycle: a cycle needs roles.rotation per_episode or per_turn"]),
    ("cycle_differs_from_assignment", edit("roles.cycle", [{"speaker": "b", "listener": "a"}]), ["roles.rotation=per_turn"],
     ["roles.assignment: {'listener': 'b', 'speaker': 'a'} differs from roles.cycle's first seating"]),
    ("no_seating", edit("roles", {"rotation": "per_turn"}), [], ["roles.assignment: missing; seat every role (role: agent), or give roles.cycle"]),
    ("agent_without_role", edit("roles.assignment", {"speaker": "a"}), [],
     ["agents.b: holds no role in roles.assignment or roles.cycle, so it would load and never act"]),
    ("alternate_three_agents", edit("agents.c", {"model": "builtin:tiny"}), ["roles.assignment.critic=c", "schedule.kind=alternate"],
     ["schedule.kind: alternate takes turns between two agents, got 3 (a, b, c); use round_robin"]),
    ("pattern_names_frozen", edit("schedule", {"kind": "pattern", "pattern": [["a", "b"]], "frozen": ["b"]}), [],
     ["schedule.pattern.0: ['b'] are also in schedule.frozen"]),
    ("data_kwargs_with_path", edit("data.kwargs", {"n": 3}), [], ["data.kwargs: ['n'] would be ignored"]),
    ("model_path_missing", edit("agents.a.model", "./models/nope"), [], ["agents.a.model: ", "models/nope' not found"]),
    ("frozen_unknown_agent", edit("schedule.frozen", ["zed"]), [], ["schedule.frozen: agent 'zed' is not defined; defined agents: a, b"]),
    ("order_unknown_agent", edit("schedule.order", ["a", "zed"]), [], ["schedule.order: agent 'zed' is not defined; defined agents: a, b"]),
    ("pattern_unknown_agent", edit("schedule.pattern", [["a"], ["zed"]]), [], ["schedule.pattern.1: agent 'zed' is not defined"]),
    ("pattern_missing", edit("schedule.kind", "pattern"), [], ["schedule.pattern: kind 'pattern' needs a non-empty list of agent lists"]),
    ("order_and_frozen", edit("schedule.frozen", ["a"]), ["schedule.order=[a]"], ["schedule.order: ['a'] are also in schedule.frozen; remove them from one"]),
    ("bad_module", edit("environment.name", "no_such_pkg_xyz.envs:Env"), [], ["environment.name: cannot import module 'no_such_pkg_xyz.envs'", "expected 'package.module:Name'"]),
    ("missing_env_file", edit("environment.name", "missing_env.py:Env"), [], ["environment.name: file ", "missing_env.py' not found; expected 'file.py:Name' relative to the config file"]),
    ("missing_attribute", edit("environment.name", f"{ENV_FILE}:Nope"), [], ["environment.name: module ", "has no attribute 'Nope'; check the name after ':'"]),
    ("not_an_import_path", edit("environment.name", "OkEnv"), [], ["environment.name: 'OkEnv' is not an import path; expected 'package.module:Name' or 'file.py:Name'"]),
    ("import_raises", env_raising_on_import, [], ["environment.name: importing ", "boom.py' raised RuntimeError: first line second line"]),
    ("factory_missing_attribute", edit("data", {"factory": f"{ENV_FILE}:make_nothing"}), [], ["data.factory: module ", "has no attribute 'make_nothing'"]),
    ("two_data_sources", edit("data.hub", "org/set"), [], ["data: set exactly one of path, factory, hub (got ['path', 'hub'])"]),
    ("no_data_source", edit("data", {}), [], ["data: set exactly one of path, factory, hub (got none)"]),
    ("data_path_missing", edit("data.path", "nope.jsonl"), [], ["data.path: file ", "nope.jsonl' not found; fix the path"]),
    ("one_generation_group_baseline", edit("train.num_generations", 1), [], ["train.num_generations: group-relative advantages need at least 2", "or algorithm.baseline=ema"]),
    ("unknown_engine", edit("agents.a.rollout.engine", "sglang"), [], ["agents.a.rollout.engine: Input should be 'hf' or 'vllm'", "(got 'sglang')"]),
    ("unknown_vllm_key", edit("agents.a.rollout", {"engine": "vllm", "vllm": {"gpu_mem": 0.5}}), [], ["agents.a.rollout.vllm.gpu_mem: unknown key; allowed keys here: gpu_memory_utilization, kv_cache_gb"]),
    ("vllm_share_out_of_range", edit("agents.a.rollout", {"engine": "vllm", "vllm": {"gpu_memory_utilization": 1.5}}), [], ["agents.a.rollout.vllm.gpu_memory_utilization: Input should be less than or equal to 1", "(got 1.5)"]),
    ("vllm_settings_for_hf", edit("agents.a.rollout.vllm", {"max_num_seqs": 8}), [], ["agents.a.rollout.vllm: vLLM settings are given but agents.a.rollout.engine is 'hf'", "set agents.a.rollout.engine: vllm or remove agents.a.rollout.vllm"]),
    ("sleep_mode_on_cpu", edit("agents.b.rollout", {"engine": "vllm", "vllm": {"sleep_mode": True}}), [], ["agents.b.rollout.vllm.sleep_mode: true frees GPU memory during updates, but agents.b.resources.num_gpus is 0", "give the agent a GPU"]),
    ("tis_cap_below_one", edit("agents.a.rollout.tis_cap", 0.5), [], ["agents.a.rollout.tis_cap: Input should be greater than or equal to 1", "(got 0.5)"]),
    ("override_without_equals", edit("train.steps", 3), ["train.steps"], ["override 'train.steps': expected dotted.key=value, e.g. train.steps=5"]),
    ("override_into_value", edit("train.steps", 3), ["train.steps.max=4"], ["override 'train.steps.max=4': 'steps' holds a value, not a section"]),
    ("override_out_of_range", edit("train.steps", 3), ["train.steps=0"], ["train.steps: Input should be greater than or equal to 1", "(got 0)"]),
]


def test_base_config_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(base()))
    assert load_config(path).agents["a"].model == "builtin:tiny"


@pytest.mark.parametrize(("make", "overrides", "expected"), [case[1:] for case in BAD], ids=[case[0] for case in BAD])
def test_bad_config_raises_one_line_error(tmp_path: Path, make, overrides: list[str], expected: list[str]) -> None:
    path = tmp_path / "run.yaml"
    content = make(tmp_path)
    if content is not None:
        path.write_text(content)

    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)

    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:")
    assert message.removeprefix(f"{path}:").lstrip().startswith(expected[0])
    for fragment in expected[1:]:
        assert fragment in message
    assert "Traceback" not in message
    assert "errors.pydantic.dev" not in message


def test_valid_example_resolves_paths_against_the_config_file(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(os.path.relpath(FIXTURES / "valid.yaml"))

    assert config.environment.name == f"{ENV_FILE}:OkEnv"
    assert config.data.path == str(FIXTURES / "data.jsonl")
    assert issubclass(import_object(config.environment.name), Environment)
    assert list(config.agents) == ["a", "b"]
    assert config.agents["a"].optimizer.lr == 0.001
    assert config.agents["b"].optimizer.lr == 1e-5
    assert (config.schedule.kind, config.schedule.order, config.schedule.frozen) == ("round_robin", ["a"], ["b"])
    assert (config.train.steps, config.train.batch_size, config.ray.enabled) == (3, 2, True)


def test_overrides_apply_on_top_of_the_file() -> None:
    overrides = ["train.steps=5", "agents.a.optimizer.lr=0.01", "ray.enabled=false"]
    config = load_config(FIXTURES / "valid.yaml", overrides)

    assert config.train.steps == 5
    assert config.agents["a"].optimizer.lr == 0.01
    assert config.ray.enabled is False
    assert config.train.batch_size == 2
    assert config.agents["b"].optimizer.lr == 1e-5


def test_override_can_switch_data_to_a_relative_factory() -> None:
    config = load_config(FIXTURES / "valid.yaml", ["data.path=null", "data.factory=env_ok.py:make_dataset"])

    assert config.data.path is None
    assert config.data.factory == f"{ENV_FILE}:make_dataset"
    assert callable(import_object(config.data.factory))


def test_overrides_take_part_in_cross_checks() -> None:
    config = load_config(FIXTURES / "valid.yaml", ["train.num_generations=1", "algorithm.baseline=ema"])

    assert (config.train.num_generations, config.algorithm.baseline) == (1, "ema")


def test_check_imports_false_skips_imports_but_still_resolves(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(edit("environment.name", "later.py:Env")(tmp_path))

    config = load_config(path, check_imports=False)

    assert config.environment.name == f"{tmp_path.resolve() / 'later.py'}:Env"


def test_the_run_plan_holds_what_the_config_implies_and_leaves_the_config_as_written():
    from protocols.config import validate_config
    from protocols.plan import plan_of

    raw = base()
    raw["agents"] = {"a": {"model": "builtin:tiny", "adapter": {}, "host": "h"},
                     "b": {"model": "builtin:tiny", "adapter": {}, "host": "h"}, "c": {"model": "builtin:tiny"}}
    raw["hosts"] = {"h": {"resources": {"num_cpus": 2}}}
    raw["roles"] = {"assignment": {"speaker": "a", "listener": "b", "judge": "c"}}
    raw["algorithm"] = {"baseline": "critic"}
    raw["critic"] = {"kind": "per_agent", "placement": "agent", "model": "agent"}
    raw["schedule"] = {"frozen": ["c"]}
    plan = plan_of(validate_config(raw, check_imports=False))
    assert plan.host_layout == {"h": ["a", "b"], "c": ["c"]}
    assert plan.critic_members == {"critic-a": ["a"], "critic-b": ["b"]}  # c is frozen: no critic of its own
    assert plan.critic_host_agents == {"critic-a": "a", "critic-b": "b"}
    assert plan.member_layout == {"h": ["a", "b", "critic-a", "critic-b"], "c": ["c"]}
    assert plan.host_resources["h"].num_cpus == 2 and plan.host_resources["c"].num_cpus == 1

    raw = base()
    raw["agents"]["a"]["rollout"] = {"max_staleness": 1}
    raw["agents"]["b"]["rollout"] = {"engine": "vllm"}
    raw["train"] = {"batch_size": 3, "num_generations": 2, "max_staleness": 2}
    config = validate_config(raw, check_imports=False)
    plan = plan_of(config)
    assert plan.staleness_bounds == {"a": 1, "b": 2}
    assert plan.engine_cache_sizes == {"b": 3 * 2}  # batch_size x num_generations x the 1 role b holds
    assert config.agents["b"].rollout.vllm.kv_cache_sequences is None  # the config stays as written
