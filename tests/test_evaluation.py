"""Held-out evaluation: when it runs, what it reports, that it never disturbs training, and `marsi eval`."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import time

import pytest

from orchestrator import rollout
from orchestrator.coordinator import Coordinator
from orchestrator.evaluation import compare, pass_at_k, summarise
from protocols.config import ConfigError, validate_config
from protocols.env import Environment
from tests.envs import HERE, config
from tests.inproc import marsi as here
from tests.runs import MARSI, marsi, rows, without_times, write

HELD_OUT = {"factory": f"{HERE / 'envs.py'}:held_out"}


def with_eval(raw, **settings):
    raw["eval"] = {"data": dict(HELD_OUT), "temperature": 1.0, **settings}
    return raw


def eval_rows(run_dir):
    return [r for r in rows(run_dir) if "eval/reward/mean" in r]


def training_rows(run_dir):
    return [r for r in rows(run_dir) if "reward/mean" in r]


# ------------------------------------------------------------------------------------------------ maths
def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 0, 3) == 0.0 and pass_at_k(4, 2, 3) == 1.0  # fewer failures than k: always solved


class _Stub(Environment):
    possible_agents, max_turns = ["x"], 1

    def reset(self, sample, seed=None):
        return {}

    def step(self, actions):
        return None


def episode(sample: int, reward: float, success: float | None = None) -> rollout.Episode:
    """A finished one-turn episode of `sample` (its group) with `reward`, reporting `success` when given."""
    e = rollout.Episode(index=0, sample_index=sample, env=_Stub())
    e.turns, e.info = [rollout.Turn([], reward, {})], ({} if success is None else {"success": success})
    return e


def test_summary_means_standard_errors_and_pass_at_k():
    # sample 0: 1 of 3 solved; sample 1: 3 of 3
    episodes = [episode(0, 1.0, 1.0), episode(0, 0.0, 0.0), episode(0, 0.0, 0.0)] + [episode(1, 1.0, 1.0)] * 3
    out = summarise(episodes, [1, 2])
    assert out["episodes"] == 6 and out["reward/mean"] == pytest.approx(4 / 6)
    assert out["reward/mean/stderr"] == pytest.approx(1 / 3)  # over the per-sample means 1/3 and 1: |1 - 1/3| / 2
    assert out["pass@1"] == pytest.approx((1 / 3 + 1) / 2)
    assert out["pass@2"] == pytest.approx((1 - 1 / 3 + 1) / 2)  # sample 0: 1 - C(2,2)/C(3,2)


def test_paired_comparison_by_hand():
    c = compare([0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0])
    assert c["difference"] == pytest.approx(0.75) and c["episodes"] == 4
    se = (0.25 * 0.75 * 4 / 3) ** 0.5 / 2  # sample std of the differences / sqrt(4)
    assert (c["low"], c["high"]) == pytest.approx((0.75 - 3.182 * se, 0.75 + 3.182 * se))
    assert not c["distinguishable"]  # the interval reaches below 0 with four episodes
    assert compare([0.0] * 10, [1.0] * 10)["distinguishable"]


def test_comparisons_and_standard_errors_are_clustered_per_sample_so_copies_add_no_confidence():
    """8 samples x 1 episode, then the same data copied 4 times (greedy evaluation of a deterministic environment
    plays copies): the interval must not narrow. Episodes as units gave [0.130, 0.620], distinguishable."""
    before = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    after = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    once = compare(before, after, list(range(8)))
    copied = compare([v for v in before for _ in range(4)], [v for v in after for _ in range(4)],
                     [s for s in range(8) for _ in range(4)])
    assert (once["low"], once["high"]) == pytest.approx((-0.247, 0.997), abs=1e-3) and not once["distinguishable"]
    assert (copied["low"], copied["high"]) == pytest.approx((once["low"], once["high"]))
    assert not copied["distinguishable"] and copied["samples"] == 8 and copied["episodes"] == 32
    # the summary's standard errors too: per-sample means are the units
    single = summarise([episode(s, r) for s, r in enumerate(after)], [])
    four = summarise([episode(s, r) for s, r in enumerate(after) for _ in range(4)], [])
    assert four["reward/mean/stderr"] == pytest.approx(single["reward/mean/stderr"]) and single["reward/mean/stderr"] > 0


def test_with_unequal_episodes_per_sample_every_figure_weighs_the_samples_alike():
    """Sample 0 has 4 episodes, sample 1 one, sample 2 two (an episode_info key some episodes leave out gives such
    counts too). The mean, its standard error and the paired difference all take the per-sample means as the units,
    so the difference is exactly after - before: the episode-weighted means disagreed with the per-sample difference
    (here +0.143 against -0.167, of opposite sign)."""
    samples = [0, 0, 0, 0, 1, 2, 2]
    before = [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    after = [0.5, 0.5, 0.5, 0.5, 0.0, 0.5, 0.5]
    c = compare(before, after, samples)
    assert c["before"] == pytest.approx((0.0 + 1.0 + 0.5) / 3) and c["after"] == pytest.approx((0.5 + 0.0 + 0.5) / 3)
    assert c["difference"] == c["after"] - c["before"]  # by construction, to the last bit
    assert c["difference"] == pytest.approx((0.5 - 1.0 + 0.0) / 3) and c["samples"] == 3 and c["episodes"] == 7
    out = summarise([episode(s, r, success=r) for s, r in zip(samples, after)], [1])
    assert out["reward/mean"] == pytest.approx(c["after"])  # the summary's mean is the same estimator
    assert out["reward/mean/stderr"] == pytest.approx(statistics.stdev([0.5, 0.0, 0.5]) / 3 ** 0.5)
    assert out["episode/success"] == pytest.approx(c["after"]) and out["pass@1"] == pytest.approx(c["after"])
    # an episode_info key that only some episodes report: each sample that reports it weighs the same
    partial = [episode(0, 0.0, success=1.0)] + [episode(0, 0.0)] * 3 + [episode(1, 0.0, success=0.0)] * 3
    assert summarise(partial, [])["episode/success"] == pytest.approx(0.5)  # not 1 / 4


def test_greedy_evaluation_with_several_episodes_per_sample_is_warned_about_once(capsys):
    with Coordinator(validate_config(with_eval(config(), episodes_per_sample=4, temperature=0.0))):
        pass
    assert capsys.readouterr().err.count("eval.episodes_per_sample is 4 at eval.temperature 0") == 1
    with Coordinator(validate_config(with_eval(config(), episodes_per_sample=4))):  # temperature 1: samples
        pass
    assert "eval.episodes_per_sample" not in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ in a run
def test_evaluations_run_at_the_configured_steps_with_the_right_counts(tmp_path):
    raw = with_eval(config(train={"steps": 4}), every=2, episodes_per_sample=3, max_samples=3,
                    partners={"b_scripted": {"b": "scripted"}})
    with Coordinator(validate_config(raw), tmp_path) as coord:
        coord.run()
    found = eval_rows(tmp_path)
    assert [r["step"] for r in found] == [0, 2, 4]
    for r in found:
        assert r["eval/episodes"] == 9 and r["eval/b_scripted/episodes"] == 9  # 3 samples x 3 episodes
        assert r["eval/b_scripted/episode/hits"] >= 1.0  # the scripted player always says the letter
        assert r["eval/reward/mean/stderr"] >= 0.0 and "eval/episode/success" in r


def test_evaluation_leaves_training_exactly_as_it_was(tmp_path):
    raw = config(train={"steps": 3})
    with Coordinator(validate_config(raw), tmp_path / "off") as coord:
        coord.run()
    with Coordinator(validate_config(with_eval(config(train={"steps": 3}), every=1)), tmp_path / "on") as coord:
        coord.run()
    assert without_times(training_rows(tmp_path / "on")) == without_times(training_rows(tmp_path / "off"))
    assert len(eval_rows(tmp_path / "on")) == 4


def test_partners_held_at_initial_weights_really_are(tmp_path):
    raw = with_eval(config(train={"steps": 2}), partners={"a_initial": {"a": "initial"}})
    for agent in raw["agents"].values():
        agent["optimizer"]["weight_decay"] = 0.1  # every update moves the weights
    with Coordinator(validate_config(raw), tmp_path) as coord:
        initial = coord.parameters_digests(["a"])["a"]
        # every setting plays the same seeds: played (not reused) at the initial weights, the partner's episodes
        # are the trained setting's, completion for completion
        played = coord.evaluation.run(coord.generate, coord.assignment, initial=False)
        said = {label: [[a["completion"] for turn in t["turns"] for a in turn["actions"]]
                        for t in played.transcripts if t["setting"] == label] for label in ("", "a_initial")}
        assert said[""] and said["a_initial"] == said[""] and played.episodes["a_initial"] == played.episodes[""]
        asked, generate = [], coord.generate
        coord.generate = lambda prompts, *a, **k: asked.append((coord.step, sorted(prompts))) or generate(prompts, *a, **k)
        coord.run()
        digests = coord.parameters_digests(["a", "a@a_initial"])
    assert digests["a"] != initial and digests["a@a_initial"] == initial
    # before any update the partner setting is the trained one: reused, not played again; after, it is played
    partner_calls = {step for step, agents in asked if "a@a_initial" in agents}
    assert partner_calls == {2}
    first, _ = eval_rows(tmp_path)
    assert first["eval/a_initial/reward/mean"] == first["eval/reward/mean"]


def test_a_kill_during_evaluation_resumes_to_the_same_records(tmp_path):
    def raw():
        return with_eval(config(train={"steps": 3, "checkpoint_every": 1}), every=1, environment_kwargs={"delay": 0.5})

    with Coordinator(validate_config(raw()), tmp_path / "whole") as coord:
        coord.run()
    run_dir = tmp_path / "cut"
    proc = subprocess.Popen([*MARSI, "run", str(write(tmp_path, raw())), "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (run_dir / "metrics.jsonl").exists() or not training_rows(run_dir):
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    time.sleep(0.7)  # the step-1 evaluation (4 resets of 0.5 s) is under way
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert [r["step"] for r in eval_rows(run_dir)] == [0]  # killed before step 1's evaluation was logged
    out = here("resume", run_dir)  # in this process: what matters is the killed one
    assert out.returncode == 0, out.stderr
    assert without_times(rows(run_dir)) == without_times(rows(tmp_path / "whole"))


# --------------------------------------------------------------------------------------- marsi eval
def test_marsi_eval_on_a_finished_run_and_on_a_config(tmp_path):
    """The first `marsi eval` in a subprocess, as a user runs it; the run and the other two in this process."""
    raw = with_eval(config(train={"steps": 2}), episodes_per_sample=2)
    assert here("run", write(tmp_path, raw), "--run-dir", tmp_path / "run").returncode == 0
    out = marsi("eval", tmp_path / "run", "--compare", "initial", "last")
    assert out.returncode == 0, out.stderr
    assert "reward/mean last (step 2) - initial: " in out.stdout and "95% CI" in out.stdout
    assert "over 4 samples" in out.stdout and "8 paired episodes, temperature 1" in out.stdout
    table = [line for line in out.stdout.splitlines() if not line.startswith("marsi: ")]  # the precision line first
    assert table[1].startswith("initial ") and table[2].startswith("last (step 2) ")
    written = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [w["checkpoint"] for w in written] == ["initial", "last"] and len(written[0]["episodes"][""]["reward/mean"]) == 8
    assert [w["step"] for w in written] == [0, 2]
    out = here("eval", tmp_path / "run", "--compare", "initial", "last", "--metric", "episode/hits",
               "eval.partners={b_initial: {b: initial}}")
    assert out.returncode == 0 and "episode/hits last (step 2) - initial: " in out.stdout, out.stderr
    assert "b_initial: episode/hits last (step 2) - initial: " in out.stdout  # a by itself, beside b as it began
    out = here("eval", write(tmp_path, raw, "alone.yaml"))
    assert out.returncode == 0, out.stderr
    table = [line for line in out.stdout.splitlines() if not line.startswith("marsi: ")]
    assert table[1].split()[:2] == ["initial", "8"]


def test_marsi_evals_table_shows_95_percent_intervals_as_the_report_does_and_says_so(capsys):
    from orchestrator.cli import _print_eval_table
    from orchestrator.evaluation import EvalResult

    result = EvalResult(metrics={"eval/reward/mean": 0.5, "eval/reward/mean/stderr": 0.1, "eval/episodes": 8.0},
                        episodes={"": {"reward/mean": [0.5] * 8}}, samples=list(range(8)))
    _print_eval_table({"last (step 2)": result})
    header, row, said = capsys.readouterr().out.splitlines()
    assert row.split()[:3] == ["last", "(step", "2)"] and "0.500 ± 0.196" in row  # 1.96 standard errors, not 1
    assert said == "mean ± 95% confidence (1.96 standard errors, clustered per held-out sample: docs/evaluation.md)"


def test_bad_eval_settings_get_one_line(tmp_path):
    overlapping = with_eval(config())
    overlapping["eval"]["data"] = {"factory": f"{HERE / 'envs.py'}:letters"}
    with pytest.raises(ConfigError, match=r"eval.data: 8 of its 8 samples are training samples too .*hold them out"):
        Coordinator(validate_config(overlapping))
    out = here("run", write(tmp_path, with_eval(config(), every_steps=2)))
    assert out.returncode == 2 and "eval.every_steps: unknown key; allowed keys here: data, every" in out.stderr
    out = here("run", write(tmp_path, with_eval(config(), pass_k=[4])))
    assert out.returncode == 2 and "eval.pass_k: k=4 needs 1 <= k <= eval.episodes_per_sample (1)" in out.stderr
    out = here("run", write(tmp_path, with_eval(config(), partners={"x": {"zed": "initial"}})))
    assert out.returncode == 2 and "eval.partners.x: agent 'zed' is not defined" in out.stderr
