"""Every example environment passes check_env; the demo config validates."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from protocols.config import load_config
from protocols.env_checker import EnvCheckError, check_env
from protocols.env import Environment, StepResult
from protocols.imports import import_object

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize("config_path", sorted(EXAMPLES.glob("*/config.yaml")), ids=lambda p: p.parent.name)
def test_example_environment_passes_check_env(config_path):
    config = load_config(config_path)
    env = import_object(config.environment.name)(**config.environment.kwargs)
    samples = import_object(config.data.factory)(**config.data.kwargs).to_list() if config.data.factory else None
    check_env(env, samples[:8], action_fn=lambda role, prompt, rng: rng.choice("abcd"))


@pytest.mark.parametrize("config_path", sorted(p for p in EXAMPLES.rglob("*.yaml") if p.name != "gpu.yaml"),
                         ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_example_config_loads_and_its_environment_builds(config_path):
    """Every YAML under examples/ (variants and ablations too; gpu.yaml names a hub model, not cached here) is a
    valid config whose environment takes its kwargs."""
    config = load_config(config_path)
    import_object(config.environment.name)(**config.environment.kwargs)


def test_relay_rewards_by_hand():
    from tests.envs import HERE  # noqa: F401  (tests package importable)

    env = import_object(f"{EXAMPLES / 'demo' / 'env.py'}:RelayEnv")()
    sample = {"letter": "c", "speaker": "..c.", "listener": ".?.."}
    assert env.reset(sample) == {"speaker": "..c."}
    first = env.step({"speaker": "cat"})
    assert first.reward == 0.5 and first.prompts == {"listener": ".c.."} and not first.terminated
    last = env.step({"listener": "x"})
    assert last.reward == 0.0 and last.terminated and env.episode_info() == {"speaker_correct": 1.0,
                                                                            "listener_correct": 0.0}
    # the listener scores only by relaying a right answer: a wrong speaker's letter decoded pays nothing
    env.reset(sample)
    assert env.step({"speaker": "d"}).prompts == {"listener": ".d.."}
    assert env.step({"listener": "c"}).reward == 0.0
    env.reset(sample)
    assert env.step({"speaker": ""}).prompts == {"listener": "...."}  # an empty answer leaves a dot
    assert env.step({"listener": "c"}).reward == 0.0


def test_relay_held_out_rows_are_longer_than_every_training_row():
    from tests.envs import HERE  # noqa: F401

    make = import_object(f"{EXAMPLES / 'demo' / 'env.py'}:make_dataset")
    train, held_out = make().to_list(), make(lengths=[6, 7, 8], n=32, seed=1).to_list()
    assert max(len(r["speaker"]) for r in train) == 4 and min(len(r["speaker"]) for r in held_out) == 6
    for row in train + held_out:
        assert row["speaker"].replace(".", "") == row["letter"] and row["listener"].replace(".", "") == "?"
    assert {r["letter"] for r in train} == {r["letter"] for r in held_out} == set("abcd")


class _Raises(Environment):
    possible_agents, max_turns = ["x"], 1

    def reset(self, sample, seed=None):
        return {"x": "hi"}

    def step(self, actions):
        if not actions["x"]:
            raise ValueError("empty")
        return StepResult(prompts={}, reward=0.0, terminated=True)


class _NaN(_Raises):
    def step(self, actions):
        return StepResult(prompts={}, reward=float("nan"), terminated=True)


class _Endless(_Raises):
    def step(self, actions):
        return StepResult(prompts={"x": "again"}, reward=0.0)


@pytest.mark.parametrize("env, message", [
    (_Raises(), "step raised ValueError"), (_NaN(), "reward nan is not finite"), (_Endless(), "past max_turns"),
])
def test_check_env_catches_broken_environments(env, message):
    with pytest.raises(EnvCheckError, match=message):
        check_env(env, [{}])


def test_the_custom_coordinator_page_shows_the_scripts_own_loop():
    import re

    page = (EXAMPLES.parent / "docs" / "custom-coordinators.md").read_text()
    [loop] = re.findall(r"```python\n(with coord:\n.*?)```", page, re.S)
    assert loop in (EXAMPLES / "custom_coordinator.py").read_text()


def test_check_env_plays_junk_at_each_turn_after_well_formed_turns():
    """Junk on every turn ends this episode at once (the proposer's junk is refused), so only junk at turn 2,
    after a well-formed proposal, reaches the solver's int()."""
    relay = import_object(f"{FIXTURES / 'number_relay.py'}:NumberRelay")
    check_env(relay(), [{}])  # without well-formed actions there is no way to turn 2
    with pytest.raises(EnvCheckError, match=r"empty actions at turn 2 after given ones, episode 1 turn 2: step raised "
                                            r"ValueError: invalid literal for int\(\) with base 10: '' at "
                                            r"tests/fixtures/number_relay.py:\d+ on actions \{'solver': ''\}"):
        check_env(relay(), [{}], action_fn=import_object(f"{FIXTURES / 'number_relay.py'}:sample_action"))


def test_custom_coordinator_script_runs_and_resumes_exactly(ray_cluster, tmp_path, monkeypatch, capsys):
    """The script as a user runs it (`python examples/custom_coordinator.py 3`, a driver joining the session's
    cluster through RAY_ADDRESS, as on a running cluster); then, run in this process (already joined) to save two
    starts of Python and Ray, its first 2 steps and their resume to step 3, which must repeat the whole run exactly.
    `marsi report | plot | eval` read its run directory (here, in this process; their subprocess runs are in
    tests/test_cli.py, test_report.py, test_evaluation.py and test_storage.py)."""
    import os
    import runpy
    import subprocess
    import sys

    import ray

    from tests.inproc import marsi

    def lines(stdout):
        return [line for line in stdout.splitlines() if line.startswith(("step", "run dir"))]

    def script_here(*args, cwd):
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [str(EXAMPLES / "custom_coordinator.py"), *map(str, args)])
        capsys.readouterr()
        runpy.run_path(str(EXAMPLES / "custom_coordinator.py"), run_name="__main__")
        return lines(capsys.readouterr().out)

    (tmp_path / "whole").mkdir()
    (tmp_path / "cut").mkdir()
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    out = subprocess.run([sys.executable, str(EXAMPLES / "custom_coordinator.py"), "3"], cwd=tmp_path / "whole",
                         capture_output=True, text=True, timeout=900, env=env)  # a hang guard, loose: a loaded machine
    assert out.returncode == 0, out.stderr
    whole = lines(out.stdout)
    assert [line.split()[5] for line in whole[:3]] == ["alice", "bob", "alice"]
    # its records are a run's: what run() logs, a spread of episodes, an evaluation; plot, report and eval read them
    [run] = (tmp_path / "whole" / "runs").glob("custom-coordinator-*")
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["trained"] for r in steps if "trained" in r] == [["alice"], ["bob"], ["alice"]]
    for key in ("reward/mean", "invalid_rate", "loss/alice", "grad_norm/alice", "groups/zero_variance/bob"):
        assert key in steps[0], key
    assert "eval/reward/mean" in steps[-1] and steps[-1]["step"] == 3
    kept = [json.loads(line) for line in (run / "transcripts.jsonl").read_text().splitlines()]
    assert [(t["step"], t["sample"]) for t in kept] == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
    assert [a["role"] for turn in kept[0]["turns"] for a in turn["actions"]] == ["speaker", "listener"]
    for command in (["report", run], ["plot", run],  # eval's trainers in this process: its checkpoints, not Ray's
                    ["eval", run, "eval.max_samples=2", "eval.episodes_per_sample=1", "ray.enabled=false"]):
        done = marsi(*command)
        assert done.returncode == 0, done.stderr
    assert (run / "reward.png").is_file()
    assert [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()] == [3]
    page = (run / "report.html").read_text()
    assert "loss per agent" in page and '"kind": "train"' in page and "step 3" in page
    first = script_here(2, cwd=tmp_path / "cut")
    [run_dir] = (tmp_path / "cut" / "runs").glob("custom-coordinator-*")  # a new directory per run
    assert (run_dir / "checkpoints" / "step-000002" / "agents" / "bob").is_dir()
    rest = script_here(3, run_dir, cwd=tmp_path / "cut")
    assert first[:2] + rest[:1] == whole[:3]  # the same rewards and losses, step for step
    assert rest[1].split("reward_ema:")[1] == whole[3].split("reward_ema:")[1]  # and the loop's own state


@pytest.mark.parametrize("config_path", sorted(EXAMPLES.glob("*/config.yaml")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_example_evaluates_on_held_out_samples(config_path):
    from orchestrator.data import load_samples
    from orchestrator.evaluation import Evaluation

    config = load_config(config_path)
    assert config.eval is not None, "every example has an eval: section"
    evaluation = Evaluation(config, load_samples(config.data))  # refuses an eval sample that is a training one
    assert len(evaluation.samples) >= 4


def test_the_demos_held_out_evaluation_is_wired(tmp_path):
    """Two short steps of the demo: its evaluation runs before and after on the held-out rows (32 x 4 episodes), and
    `compare` pairs the two (that it improves is benchmarks/demo_seeds.py's to show, over seeds)."""
    from orchestrator.coordinator import Coordinator
    from orchestrator.evaluation import compare

    config = load_config(EXAMPLES / "demo" / "config.yaml", ["ray.enabled=false", "train.steps=2", "train.batch_size=2",
                                                             "train.num_generations=2", "train.progress=false"])
    with Coordinator(config, run_dir=tmp_path / "run") as coord:
        assert {len(s["speaker"]) for s in coord.evaluation.samples} == {6, 7, 8}
        coord.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval/reward/mean" in row]
    assert [row["step"] for row in evals] == [0, 2] and {row["eval/episodes"] for row in evals} == {128}
    assert [step for step, _ in coord.eval_results] == [0, 2]  # the episodes behind those rows, kept for `compare`
    (_, before), (_, after) = coord.eval_results
    assert len(before.episodes[""]["reward/mean"]) == 128 and len(set(before.samples)) == 32
    assert before.samples == after.samples  # the same held-out episodes at both ends: pairs
    assert statistics.fmean(after.episodes[""]["reward/mean"]) == pytest.approx(evals[1]["eval/reward/mean"])
    c = compare(before.episodes[""]["reward/mean"], before.episodes[""]["reward/mean"], before.samples)
    assert c["difference"] == 0.0 and c["samples"] == 32


# ------------------------------------------------------------------------------------------ guess
def _guess(name: str):
    return import_object(f"{EXAMPLES / 'guess' / 'env.py'}:{name}")


def test_guess_pays_only_a_pick_of_the_secret_word_alone():
    env = _guess("GuessEnv")()
    sample = {"word": "cat", "options": ["dog", "cat", "tree", "bed"]}
    assert "cat" in env.reset(sample)["describer"]
    first = env.step({"describer": "A small pet.  It purrs\nand meows."})
    assert first.reward == 0.0 and not first.terminated and list(first.prompts) == ["guesser"]
    assert "Options: dog, cat, tree, bed." in first.prompts["guesser"] and "Clue: A small pet. It purrs and meows." \
        in first.prompts["guesser"]
    last = env.step({"guesser": "The answer is: Cats."})
    assert last.reward == 1.0 and last.terminated
    assert env.episode_info() == {"guess_correct": 1.0, "success": 1.0, "said_word": 0.0, "named_options": 1.0}
    for guess, named in [("dog", 1.0), ("cat or dog", 2.0), ("a feline", 0.0), ("", 0.0), ("category", 0.0)]:
        env.reset(sample)
        env.step({"describer": "A small pet."})
        result = env.step({"guesser": guess})
        assert result.reward == 0.0, guess  # a wrong pick, a hedge over two options, or none pays nothing
        assert env.episode_info()["named_options"] == named
        assert (result.infos.get("guesser", {}).get("invalid", False)) == (named == 0.0)


def test_guess_masks_the_secret_word_in_the_description():
    env = _guess("GuessEnv")()
    env.reset({"word": "box", "options": ["box", "cat", "tree", "bed"]})
    shown = env.step({"describer": "Boxes! A BOX holds a toolbox."}).prompts["guesser"]
    assert "Clue: ___! A ___ holds a toolbox." in shown  # the word and its plural in any case; not inside words
    assert env.step({"guesser": "box"}).reward == 1.0 and env.episode_info()["said_word"] == 1.0
    env.reset({"word": "box", "options": ["box", "cat", "tree", "bed"]})
    result = env.step({"describer": "   "})
    assert "Clue: (nothing)" in result.prompts["guesser"] and result.infos["describer"]["invalid"]


def test_guess_held_out_words_never_appear_in_training_rows():
    make, held_out = _guess("make_dataset"), set(_guess("HELD_OUT"))
    train, evaluation = make().to_list(), make(split="eval", n=48, seed=1).to_list()
    assert not held_out & {w for row in train for w in row["options"]}
    assert {w for row in evaluation for w in row["options"]} <= held_out
    assert {row["word"] for row in evaluation} == held_out  # every held-out word is a secret twice
    for row in train + evaluation:
        assert len(set(row["options"])) == 4 and row["word"] in row["options"]
    assert make(seed=3).to_list() == make(seed=3).to_list() != make(seed=4).to_list()
    with pytest.raises(ValueError, match="split must be"):
        make(split="test")


def test_the_guess_recipes_partner_evaluation_is_wired(tmp_path):
    """One step of the SmolLM2 recipe on the tiny model (its wiring, not its learning): the evaluation plays the
    held-out words as trained and beside each partner at its initial weights, before and after."""
    from orchestrator.coordinator import Coordinator

    config = load_config(EXAMPLES / "guess" / "config.yaml", [
        "ray.enabled=false", "train.steps=1", "train.batch_size=1", "train.num_generations=2", "train.progress=false",
        "agents.alice.model=builtin:tiny", "agents.bob.model=builtin:tiny", "eval.max_samples=4"])
    with Coordinator(config, run_dir=tmp_path / "run") as coord:
        assert set(coord.evaluation.samples[0]["options"]) <= set(_guess("HELD_OUT"))
        coord.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval/reward/mean" in row]
    assert [row["step"] for row in evals] == [0, 1]
    for label in ("", "bob_initial/", "alice_initial/"):
        assert all(row[f"eval/{label}episodes"] == 8 for row in evals), label
