"""The coordinator with real trainers: schedules, role rotation, processes, Ray on and off."""

from __future__ import annotations

import json
import os
import time

import pytest

from orchestrator.coordinator import Coordinator
from orchestrator.steplog import computed
from protocols.config import validate_config
from tests.envs import config


def run(raw, tmp_path=None, steps=None):
    cfg = validate_config(raw)
    with Coordinator(cfg, tmp_path) as coord:
        history = coord.run()
    return history


def without_times(history):
    return [computed(m) for m in history]


def test_alternate_changes_only_the_scheduled_agent_and_never_the_frozen_one():
    """In-process trainers (three Ray trainers were three processes to start; the digests of Ray trainers are
    compared the same way in tests/test_vllm.py's self-play test)."""
    raw = config(("a", "b", "judge"), schedule={"kind": "alternate", "order": ["a", "b"], "frozen": ["judge"]},
                 train={"steps": 4})
    for agent in raw["agents"].values():  # weight decay moves every updated agent, even when all advantages are 0
        agent["optimizer"]["weight_decay"] = 0.1
    with Coordinator(validate_config(raw)) as coord:
        trained = []
        for step in range(4):
            before = coord.parameters_digests()
            coord.run(until=step + 1)
            after = coord.parameters_digests()
            trained.append(sorted(a for a in before if before[a] != after[a]))
    assert trained == [["a"], ["b"], ["a"], ["b"]]


def test_pattern_and_round_robin_train_the_listed_agents():
    raw = config(("a", "b", "c"), schedule={"kind": "pattern", "pattern": [["a", "b"], ["c"]]}, train={"steps": 3})
    assert [m["trained"] for m in run(raw)] == [["a", "b"], ["c"], ["a", "b"]]
    raw = config(("a", "b", "c"), schedule={"kind": "round_robin", "period": 2}, train={"steps": 6})
    assert [m["trained"] for m in run(raw)] == [["a"], ["a"], ["b"], ["b"], ["c"], ["c"]]


def test_each_agent_is_its_own_process_on_its_own_gpu_with_the_metrics_of_ray_off(ray_cluster):
    """Two Ray trainers, one (logical) GPU each, and the same seed's run with Ray off: the same metrics."""
    off = run(config(train={"steps": 3}))
    assert off[0]["trained"] == ["a", "b"] and "loss/a" in off[0]
    raw = config(ray=True, train={"steps": 3})
    for agent in raw["agents"].values():
        agent["resources"] = {"num_cpus": 0.5, "num_gpus": 1}
    with Coordinator(validate_config(raw)) as coord:
        info = coord.pool.info()
        history = coord.run()
    pids = {i["pid"] for i in info.values()}
    assert len(pids) == 2 and os.getpid() not in pids
    visible = sorted(i["cuda_visible_devices"] for i in info.values())
    assert visible == ["0", "1"], info
    assert all(i["device"] == "cpu" for i in info.values())  # no CUDA here: falls back to CPU
    assert without_times(history) == without_times(off)
    # each step's peak memory: per process, so one key for the two agents of one process and one each apart
    assert {k for k in off[0] if k.startswith("memory/")} == {"memory/peak_mib/a+b"}
    assert {k for k in history[0] if k.startswith("memory/")} == {"memory/peak_mib/a", "memory/peak_mib/b"}
    assert all(100 < row[f"memory/peak_mib/{a}"] < 4096 for row in history for a in "ab")  # a trainer's process
    # start-up, timed: each actor's start holds its model load; the coordinator reports the slowest load
    assert all(0 < i["load_s"] < i["start_s"] for i in info.values())
    up = coord.startup
    assert up["model_load_s"] == max(i["load_s"] for i in info.values())
    assert up["model_load_s"] < up["trainers_s"] < up["total_s"] and up["ray_s"] >= 0


def test_rotation_per_episode_and_per_turn(tmp_path):
    def seats(rotation, turns):
        raw = config(roles={"r0": "a", "r1": "b"}, turns=turns,
                     train={"steps": 1, "transcripts_per_step": 100, "batch_size": 1, "num_generations": 4})
        raw["roles"] = {"assignment": {"r0": "a", "r1": "b"}, "rotation": rotation}
        run(raw, tmp_path / rotation)
        rows = [json.loads(line) for line in (tmp_path / rotation / "transcripts.jsonl").read_text().splitlines()]
        return {(r["episode"], t): tuple(a["agent"] for a in sorted(turn["actions"], key=lambda a: a["role"]))
                for r in rows for t, turn in enumerate(r["turns"])}

    per_episode = seats("per_episode", turns=2)
    assert len(per_episode) == 8  # 4 episodes x 2 turns
    for (episode, turn), agents in per_episode.items():
        assert agents == (("a", "b") if episode % 2 == 0 else ("b", "a"))
    per_turn = seats("per_turn", turns=2)
    for (episode, turn), agents in per_turn.items():
        assert agents == (("a", "b") if turn == 0 else ("b", "a"))


def test_explicit_cycle_and_self_play_with_one_agent(tmp_path):
    raw = config(("solo",), roles={"x": "solo", "o": "solo"}, train={"steps": 1, "transcripts_per_step": 10})
    history = run(raw, tmp_path)
    assert history[0]["trained"] == ["solo"] and history[0]["tokens/solo"] > 0
    row = json.loads((tmp_path / "transcripts.jsonl").read_text().splitlines()[0])
    assert {a["role"]: a["agent"] for a in row["turns"][0]["actions"]} == {"x": "solo", "o": "solo"}


def test_zero_sum_rewards_with_ema_baselines():
    raw = config(roles={"r0": "a", "r1": "b"}, algorithm={"baseline": "ema"}, train={"steps": 2})
    raw["environment"]["kwargs"]["zero_sum"] = True
    history = run(raw)
    assert {"reward/r0", "reward/r1"} <= set(history[0])
    assert history[0]["reward/r0"] == pytest.approx(-history[0]["reward/r1"])


def test_primitives_for_a_custom_loop():
    from protocols.messages import Experience

    with Coordinator(validate_config(config())) as coord:
        out = coord.generate({"a": ["Say a", "Say b"], "b": ["Say c"]}, seed=3)
        assert [len(out["a"]), len(out["b"])] == [2, 1]
        before = coord.parameters_digests()
        results = coord.train({"b": [Experience.from_completion(c, 1.0) for c in out["b"]]})
        after = coord.parameters_digests()
    assert list(results) == ["b"] and after["a"] == before["a"] and after["b"] != before["b"]


def test_a_request_larger_than_the_cluster_is_refused_at_once(ray_cluster):
    from agent_trainer.actor import PlacementError

    raw = config(ray=True)
    raw["agents"]["a"]["resources"] = {"num_cpus": 0.5, "num_gpus": 4}
    start = time.monotonic()
    with pytest.raises(PlacementError, match=r"agents ask for 4 GPUs in all \(a: 4, b: 0\) but the Ray cluster has 2; "
                                             r"lower agents.NAME.resources.num_gpus"):
        with Coordinator(validate_config(raw)):
            pass
    assert time.monotonic() - start < 30  # not after placement_timeout_s (60 s)


def test_placement_timeout_lists_asked_and_free_resources(ray_cluster):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from agent_trainer.actor import PlacementError

    held = placement_group([{"GPU": 2}])  # another job holds both GPUs: the request fits the cluster, not what is free
    ray.get(held.ready())
    try:
        raw = config(ray=True)
        raw["agents"]["a"]["resources"] = {"num_cpus": 0.5, "num_gpus": 1}
        raw["ray"]["placement_timeout_s"] = 1
        with pytest.raises(PlacementError, match=r"asked for a: \{'CPU': 0.5, 'GPU': 1.0\}.*cluster has free "):
            with Coordinator(validate_config(raw)):
                pass
    finally:
        remove_placement_group(held)


def test_the_coordinator_process_imports_no_torch_or_transformers():
    """The driver holds no model: with Ray, torch and transformers load only in the trainer processes."""
    import subprocess
    import sys

    code = ("import sys, orchestrator.cli, orchestrator.coordinator, orchestrator.evaluation, agent_trainer.actor; "
            "print(sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip() == "[]"


def test_visible_gpus_are_counted_as_ray_counts_them(monkeypatch):
    from agent_trainer.group import visible_gpus

    for visible, count in (("0,1", 2), ("3", 1), ("", 0), ("-1", 0)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert visible_gpus() == count, visible
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == (len(os.listdir("/proc/driver/nvidia/gpus")) if os.path.isdir("/proc/driver/nvidia/gpus") else 0)
