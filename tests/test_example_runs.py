"""Each issue-4 example config runs the whole loop through the coordinator, Ray real, on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.coordinator import Coordinator
from protocols.config import load_config
from tests.inproc import marsi
from tests.runs import killed_and_resumed, rows, without_times

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# config -> (train.* overrides, extra overrides, expected `trained` per step, expected metric keys)
CASES = {
    "self_improve/config.yaml": (
        {"steps": 2}, [], [["student"], ["student"]],
        ["episode/first_correct", "episode/final_correct", "loss/student"]),
    "tictactoe/config.yaml": (
        {"steps": 2}, [], [["player"], ["player"]],
        ["reward/X", "reward/O", "episode/legal_move_rate", "loss/player"]),
    "tictactoe/eval_random.yaml": (
        {"steps": 1}, [], [[]],
        ["episode/win", "episode/draw", "episode/loss", "episode/legal_move_rate"]),
    "rsi/ablations/fixed_generator.yaml": (  # the environment writes the problems: the student trains on tiny
        {"steps": 1, "batch_size": 1, "num_generations": 2}, ["eval.max_samples=4"], [["student"]],
        ["episode/solver_success", "episode/format_valid", "reward/solver", "loss/student"]),
    "debate/config.yaml": (
        {"steps": 1}, [], [["alice", "bob"]],
        ["episode/first_majority_correct", "episode/final_majority_correct", "loss/alice", "loss/bob"]),
}


def tiny(path: Path, train: dict, extra: list[str]) -> list[str]:
    """Overrides that put every agent of `path` on the tiny model with tiny settings."""
    agents = load_config(path).agents
    overrides = [f"agents.{a}.{key}" for a in agents for key in (
        "model=builtin:tiny", "generation.max_completion_length=4", "optimizer.lr=1.0e-3")]
    train = {"batch_size": 2, "num_generations": 2, "progress": False, "transcripts_per_step": 1, **train}
    return overrides + [f"train.{k}={v}" for k, v in train.items()] + extra


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_config_runs_end_to_end(name, ray_cluster, tmp_path):
    train, extra, trained, keys = CASES[name]
    path = EXAMPLES / name
    config = load_config(path, tiny(path, train, extra))
    assert config.ray.enabled and all(a.model == "builtin:tiny" for a in config.agents.values())
    with Coordinator(config, tmp_path) as coord:
        before = coord.parameters_digests()
        history = coord.run()
        after = coord.parameters_digests()
    assert [m["trained"] for m in history] == trained
    for metrics, agents in zip(history, trained):  # each scheduled agent ran an update on its tokens
        assert all(metrics[f"tokens/{a}"] > 0 and f"loss/{a}" in metrics for a in agents)
    # Only scheduled agents may change (with tiny random models the advantages are often all 0, so a
    # scheduled agent's weights may stay put); a frozen or never-scheduled agent must not change.
    assert {a for a in before if before[a] != after[a]} <= {a for step in trained for a in step}
    logged = {key for metrics in history for key in metrics}
    for key in ["reward/mean", "invalid_rate", "time/step", *keys]:
        assert key in logged, f"{name}: {key} missing from {sorted(logged)}"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == list(range(1, len(trained) + 1))
    evaluated = [0, len(trained)] if config.eval else []  # before the first step and after the last
    assert [r["step"] for r in rows if "eval/reward/mean" in r] == evaluated
    assert (tmp_path / "checkpoints").is_dir()


def test_rsi_recipe_runs_through_the_cli_and_a_run_killed_mid_run_resumes_identically(tmp_path):
    """examples/rsi/config.yaml on builtin:tiny through `marsi run` (its random teacher writes no valid problem: each
    proposal pays the invalid penalty; the held-out evaluation seats the student), then the same run SIGKILLed
    after its first step and `marsi resume`d ends with the same metrics. Without Ray: a run's trainers on Ray, killed
    and restored, are the subject of tests/test_reliability.py; here the recipe is."""
    raw = yaml.safe_load((EXAMPLES / "rsi/config.yaml").read_text())
    raw["environment"]["name"] = f"{EXAMPLES / 'rsi/env.py'}:RSIEnv"
    for section in (raw["data"], raw["eval"]["data"]):
        section["factory"] = f"{EXAMPLES / 'rsi/env.py'}:make_dataset"
    for agent in raw["agents"].values():
        agent.update(model="builtin:tiny", generation={"max_completion_length": 4}, optimizer={"lr": 1.0e-3})
    raw["eval"]["max_samples"] = 4
    raw["train"].update(steps=3, batch_size=2, num_generations=2, progress=False, checkpoint_every=1)
    raw["ray"] = {"enabled": False}
    config = tmp_path / "rsi.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = marsi("run", config, "--run-dir", tmp_path / "whole")
    assert out.returncode == 0, out.stderr
    whole = rows(tmp_path / "whole")
    training = [r for r in whole if "reward/mean" in r]
    assert [r["trained"] for r in training] == [["teacher"]] * 3  # the student had no problem to solve
    assert all(r["reward/proposer"] == -0.5 and r["episode/valid_problem"] == 0.0 and r["no_experiences/student"]
               for r in training)
    evaluated = [r for r in whole if "eval/reward/mean" in r]
    assert [r["step"] for r in evaluated] == [0, 3] and all(r["eval/episodes"] == 4.0 for r in evaluated)
    assert all({"eval/episode/accuracy", "eval/episode/format_valid"} <= set(r) for r in evaluated)
    assert killed_and_resumed(config, tmp_path / "killed", 3) == without_times(whole)
