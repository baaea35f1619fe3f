"""The schedule's memory plan (orchestrator/memory_plan.py): who keeps its optimizer state before each step, what
the coordinator tells the trainers, and the table `marsi validate` prints."""

from __future__ import annotations

import pytest
import yaml

from orchestrator.memory_plan import AgentBytes, MemoryPlan, estimate, plan_table
from orchestrator.schedule import Schedule
from protocols.config import ConfigError, validate_config
from tests.envs import config
from tests.inproc import marsi


def plan_of(schedule: dict, agents=("a", "b", "c"), lag: int = 0, offload: dict | None = None):
    raw = config(agents, schedule=schedule)
    for name, setting in (offload or {}).items():
        raw["agents"][name]["optimizer"]["offload"] = setting
    cfg = validate_config(raw)
    sched = Schedule(cfg.schedule, list(cfg.agents))
    return cfg, sched, MemoryPlan(cfg, sched, lag)


def test_round_robin_keeps_the_next_updater_and_releases_the_others():
    _, _, plan = plan_of({"kind": "round_robin"})
    assert plan.offloaded == ["a", "b", "c"]
    assert [plan.kept(s) for s in range(4)] == [{"a"}, {"b"}, {"c"}, {"a"}]
    assert list(plan.calls(0, start=True).items()) == [("b", False), ("c", False), ("a", True)]  # releases first
    assert plan.calls(1) == {"a": False, "b": True}  # after a's update: a releases, b fetches
    assert plan.calls(2) == {"b": False, "c": True}


def test_rollouts_played_ahead_fetch_earlier():
    _, _, plan = plan_of({"kind": "round_robin"}, lag=1)
    assert [plan.kept(s) for s in range(3)] == [{"a", "b"}, {"b", "c"}, {"c", "a"}]
    assert plan.calls(1) == {"a": False, "c": True}


def test_alternate_with_a_period_changes_only_at_the_turns():
    _, _, plan = plan_of({"kind": "alternate", "order": ["a", "b"], "period": 3}, agents=("a", "b"))
    assert [plan.calls(s) for s in range(1, 7)] == [{}, {}, {"a": False, "b": True}, {}, {}, {"b": False, "a": True}]


def test_simultaneous_frozen_and_off_are_never_released():
    _, _, plan = plan_of({"kind": "simultaneous"})
    assert plan.offloaded == []
    _, _, plan = plan_of({"kind": "round_robin", "order": ["a", "b"], "frozen": ["c"]}, offload={"b": "off"})
    assert plan.offloaded == ["a"]
    assert plan.calls(0, start=True) == {"a": True} and plan.calls(1) == {"a": False}


def test_the_setting_is_checked_and_read_as_yaml_writes_it():
    raw = yaml.safe_load("agents: {a: {optimizer: {offload: off}}, b: {optimizer: {offload: auto}}}")
    assert raw["agents"]["a"]["optimizer"]["offload"] is False  # YAML's reading of a bare off
    full = config(("a", "b"))
    for name in ("a", "b"):
        full["agents"][name]["optimizer"].update(raw["agents"][name]["optimizer"])
    cfg = validate_config(full)
    assert [cfg.agents[a].optimizer.offload for a in ("a", "b")] == ["off", "auto"]
    raw = config(("a", "b"))
    raw["agents"]["a"]["optimizer"]["offload"] = "sometimes"
    with pytest.raises(ConfigError, match="offload"):
        validate_config(raw)


def test_the_table_of_a_round_robin_run():
    cfg, _, memory = plan_of({"kind": "round_robin", "order": ["a", "b"], "frozen": ["c"]})
    sizes, base = estimate(cfg, {a: (1 << 20, 1 << 20) for a in cfg.agents})
    assert sizes["a"] == AgentBytes(weights=4 << 20, gradients=4 << 20, optimizer=8 << 20, engine=0)
    assert sizes["c"] == AgentBytes(weights=4 << 20, gradients=0, optimizer=0, engine=0)
    lines = plan_table(cfg, {a: [a] for a in cfg.agents}, memory, sizes, base)
    assert "2-step cycle" in lines[0]
    assert lines[1].split() == ["host", "(agents)", "weights", "grads", "optimizer", "engine", "step", "1", "step", "2"]
    assert lines[2].split() == ["a", "4.0M", "4.0M", "8.0M", "0", "U", "16.0M", "-", "4.0M"]
    assert lines[3].split() == ["b", "4.0M", "4.0M", "8.0M", "0", "-", "4.0M", "U", "16.0M"]
    assert lines[4].split() == ["c", "4.0M", "0", "0", "0", "F", "4.0M", "F", "4.0M"]
    assert lines[5].strip() == ("all hosts: peak 24.0M with this plan, 36.0M with every optimizer resident and "
                                "every gradient held")


def test_validate_prints_the_plan(tmp_path):
    path = tmp_path / "rr.yaml"
    path.write_text(yaml.safe_dump(config(("a", "b", "c"), schedule={"kind": "round_robin"})))
    result = marsi("validate", path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "memory plan, estimated per host at each step of the schedule's 3-step cycle" in out
    table = out[out.index("memory plan"):].splitlines()
    assert table[2].split()[-6:] == ["U", table[2].split()[-5], "-", table[2].split()[-3], "-", table[2].split()[-1]]
    assert "all hosts: peak" in out
