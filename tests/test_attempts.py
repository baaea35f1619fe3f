"""Repeated attempts at one prompt (`Environment.attempts`, `roles.attempts`): one batched generate, advantages
centred within the k attempts, metrics under the role, pass@k over the attempts, refusals, and runs through the CLI
that resume exactly."""

from __future__ import annotations

import json
import math

import pytest

from orchestrator import rollout
from orchestrator.advantages import scored_actions
from orchestrator.baselines import experiences_by_agent
from orchestrator.cli import main
from orchestrator.coordinator import Coordinator
from orchestrator.evaluation import summarise
from orchestrator.steplog import step_metrics
from protocols.config import AlgorithmConfig, validate_config
from protocols.env_checker import EnvCheckError, check_env
from protocols.messages import Completion
from protocols.plan import plan_of
from tests.envs import HERE, AttemptsEnv, FaultyAttemptsEnv, attempts_config, letters
from tests.errors_doc import assert_documented
from tests.runs import killed_and_resumed, rows, uninterrupted_rows, write

SEATS = {"proposer": "p", "solver": "s"}
HELD_OUT = {"factory": f"{HERE / 'envs.py'}:held_out"}


def scripted(answers: dict[str, list[str]], calls: list):
    """A generate function: agent X's i-th row of each call answers `answers[X][i]`; every call is kept in `calls`."""
    def generate(prompts, seed):
        calls.append(prompts)
        return {agent: [Completion(text=answers[agent][i], prompt_ids=[1], completion_ids=[2], per_token_logps=[-0.1],
                                   finish_reason="stop") for i in range(len(ps))] for agent, ps in prompts.items()}
    return generate


def play_two(calls=None, attempts=None, solver=("a", "", "a", "a", "a", "a")):
    """One sample ('a'), two episodes: the proposer names 'a' in both; the solver's attempts are `solver`, in row
    order (episode 1's three, then episode 2's): right, empty (wrong and invalid), right | right, right, right."""
    answers = {"p": ["a", "a"], "s": list(solver)}
    return rollout.play(AttemptsEnv, [{"target": "a"}], 2, lambda e, t: SEATS,
                        scripted(answers, calls if calls is not None else []), seed=0, first_episode=0,
                        attempts=attempts)


# ------------------------------------------------------------------------------------- pure logic
def test_the_k_attempts_share_one_prompt_in_one_batched_generate_and_step_gets_them_together():
    calls = []
    episodes = play_two(calls)
    assert calls == [{"p": ["Say a", "Say a"]}, {"s": ["Say a"] * 6}]  # one generate per turn; k rows per prompt
    for episode in episodes:
        proposer, solver = episode.turns
        assert [a.attempt for a in proposer.actions] == [None]
        assert [(a.role, a.agent, a.prompt, a.attempt) for a in solver.actions] == [
            ("solver", "s", "Say a", i) for i in range(3)]
    assert episodes[0].turns[1].reward == {"proposer": pytest.approx(1 / 3), "solver": [1.0, 0.0, 1.0]}
    # roles.attempts overrides the environment's k
    calls = []
    episodes = play_two(calls, attempts={"solver": 2}, solver=("a", "b", "a", "a"))
    assert calls[1] == {"s": ["Say a"] * 4} and episodes[0].turns[1].reward["solver"] == [1.0, 0.0]


class BatchCountingEnv(AttemptsEnv):
    """AttemptsEnv that counts, at the solver's turn, the proposals its batch made at turn 1."""

    def step(self, actions):
        if "proposer" in actions:
            self.batch.setdefault("proposals", []).append(actions["proposer"])
        else:
            self.seen = len(self.batch["proposals"])
        return super().step(actions)

    def episode_info(self):
        return {"seen": self.seen}


def test_the_environments_of_one_call_share_one_batch_and_the_next_call_gets_a_fresh_one():
    answers = {"p": ["a", "a", "a", "a"], "s": ["a"] * 12}
    play = lambda: rollout.play(BatchCountingEnv, [{"target": "a"}, {"target": "b"}], 2, lambda e, t: SEATS,
                                scripted(answers, []), seed=0, first_episode=0)
    first, second = play(), play()
    assert [e.info["seen"] for e in first + second] == [4.0] * 8  # every turn 1 of its call, none of the other's
    assert len({id(e.env.batch) for e in first}) == 1 and first[0].env.batch is not second[0].env.batch


def test_attempt_advantages_are_centred_within_the_k_and_the_proposer_groups_over_the_samples_episodes():
    episodes = play_two()
    # solver: episode 1 [1, 0, 1] (mean 2/3), episode 2 [1, 1, 1]; proposer: learnability 1/3 and 0 (mean 1/6)
    out = experiences_by_agent(episodes, AlgorithmConfig(scale_rewards=False), {})
    assert [e.advantage for e in out["s"]] == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0, 0, 0])
    assert [e.advantage for e in out["p"]] == pytest.approx([1 / 6, -1 / 6])
    # scaled by the std of the k (population: sqrt(2) / 3), as GRPO does per prompt
    scaled = [c / (math.sqrt(2) / 3 + 1e-4) for c in (1 / 3, -2 / 3, 1 / 3)] + [0] * 3
    out = experiences_by_agent(play_two(), AlgorithmConfig(), {})
    assert [e.advantage for e in out["s"]] == pytest.approx(scaled)
    assert [e.advantage for e in out["p"]] == pytest.approx([(1 / 6) / (1 / 6 + 1e-4), -(1 / 6) / (1 / 6 + 1e-4)])
    # each agent its own settings: the proposer unscaled here, then on an EMA baseline (from 0: its returns)
    own = AlgorithmConfig(agents={"p": {"scale_rewards": False}})
    out = experiences_by_agent(play_two(), own, {})
    assert [e.advantage for e in out["p"]] == pytest.approx([1 / 6, -1 / 6])
    assert [e.advantage for e in out["s"]] == pytest.approx(scaled)
    baselines = {}
    out = experiences_by_agent(play_two(), AlgorithmConfig(agents={"p": {"baseline": "ema"}}), baselines)
    assert [e.advantage for e in out["p"]] == pytest.approx([1 / 3, 0.0]) and list(baselines) == ["p"]
    # k = 1: no group of one (advantage 0 always); the one attempt groups over the sample's episodes, as an answer
    one = play_two(attempts={"solver": 1}, solver=("a", "b"))
    out = experiences_by_agent(one, AlgorithmConfig(scale_rewards=False), {})
    assert [e.advantage for e in out["s"]] == pytest.approx([0.5, -0.5])


def test_an_attempts_return_is_its_own_reward_plus_the_discounted_later_rewards():
    """Turn 1: two attempts rewarded 1 and 0; turn 2: two more, rewarded 0.2 and 0.4 (their mean, 0.3, is the role's
    reward there). With discount 0.9: 1 + 0.27, 0 + 0.27, then 0.2 and 0.4."""
    env = AttemptsEnv()
    env.attempts = {"solver": 2}

    def action(i):
        return rollout.Action("solver", "s", "p", Completion(text="x", prompt_ids=[1], completion_ids=[2],
                                                            per_token_logps=[-1.0], finish_reason="stop"), attempt=i)

    turns = [rollout.Turn([action(0), action(1)], {"solver": [1.0, 0.0]}, {}),
             rollout.Turn([action(0), action(1)], {"solver": [0.2, 0.4]}, {})]
    episode = rollout.Episode(index=0, sample_index=0, env=env, turns=turns)
    _, returns, keys, _ = scored_actions([episode], AlgorithmConfig(discount=0.9))
    assert returns == pytest.approx([1.27, 0.27, 0.2, 0.4])
    assert keys[0] == keys[1] != keys[2] == keys[3]  # each prompt's attempts: a group of their own


def test_metrics_average_the_attempts_under_their_role():
    metrics = step_metrics(1, play_two(), {}, {}, 0.0)
    assert metrics["reward/solver"] == pytest.approx((2 / 3 + 1) / 2)
    assert metrics["reward/proposer"] == pytest.approx((1 / 3 + 0) / 2)
    assert not [k for k in metrics if k.startswith("reward/solver_")]
    assert metrics["invalid_rate"] == pytest.approx(1 / 8)  # one empty attempt among 2 proposals and 6 attempts


def test_evaluation_reports_pass_at_k_over_each_prompts_attempts():
    """Episode 1's attempts: 2 of 3 right; episode 2's: 3 of 3. pass@1 = (2/3 + 1) / 2; pass@2 and pass@3: 1 (episode
    1: 1 - C(1, k) / C(3, k) = 1)."""
    out = summarise(play_two(), [1, 2, 3])
    assert out["pass@1/solver"] == pytest.approx(5 / 6)
    assert out["pass@2/solver"] == out["pass@3/solver"] == 1.0
    assert out["pass@1/solver/stderr"] == 0.0  # one sample: its prompts are one cluster
    episodes = play_two(solver=("b", "b", "a", "b", "b", "b"))  # 1 of 3, then 0 of 3
    out = summarise(episodes, [1, 2])
    assert out["pass@1/solver"] == pytest.approx((1 / 3 + 0) / 2) and out["pass@2/solver"] == pytest.approx((2 / 3) / 2)
    assert "pass@1" not in out  # no episode reports success: nothing over episodes


def test_pass_at_k_over_attempts_weighs_each_sample_alike_as_its_standard_error_does():
    """Sample 0 has two prompts (2 of 3 right, 3 of 3), sample 1 one (0 of 3): pass@1 is the mean of the per-sample
    means, (5/6 + 0) / 2, not the mean over prompts, (2/3 + 1 + 0) / 3."""
    episodes = play_two()
    [third] = play_two(solver=("b", "b", "b", "b", "b", "b"))[:1]
    third.sample_index = 1
    out = summarise([*episodes, third], [1])
    assert out["pass@1/solver"] == pytest.approx((5 / 6 + 0) / 2)
    assert out["pass@1/solver/stderr"] == pytest.approx(abs(5 / 6 - 0) / 2)  # sample std of (5/6, 0) / sqrt(2)


def test_evaluation_plays_the_training_k_unless_eval_attempts_says_otherwise(capsys):
    """Four held-out samples, one episode each, answered by a scripted solver that is always right."""
    answers = {"p": ["a"] * 4, "s": ["a"] * 12}
    for attempts, rows_asked in (({}, 12), ({"solver": 1}, 4)):
        raw = attempts_config(eval={"data": HELD_OUT, "pass_k": [1], "attempts": attempts})
        coord = Coordinator(validate_config(raw))  # not started: no trainers, the generate is scripted
        calls = []
        generate = scripted(answers, calls)
        result = coord.evaluation.run(lambda prompts, seed, temperature: generate(prompts, seed), coord.assignment)
        assert len(calls[1]["s"]) == rows_asked and result.metrics["eval/pass@1/solver"] == 1.0
        warned = "eval.temperature 0 with attempts (solver): greedy decoding plays copies" in capsys.readouterr().err
        assert warned == (not attempts)


def test_check_env_plays_attempts_roles_with_k_answers():
    seen = []

    def act(role, prompt, rng):
        seen.append(role)
        return "a"

    check_env(AttemptsEnv(), letters().to_list(), action_fn=act, episodes=1)
    assert seen[:4] == ["proposer", "solver", "solver", "solver"]
    for fault, message in (("rewards_short", "reward of 'solver' lists 2 values for its 3 attempts"),
                           ("infos_short", r"infos\['solver'\] 'attempts' must be a list of 3 dicts"),
                           ("attempts_zero", r"attempts must be a dict role -> k \(an int >= 1\)")):
        with pytest.raises(EnvCheckError, match=message):
            check_env(FaultyAttemptsEnv(fault), letters().to_list())


# ------------------------------------------------------------------------------------- refusals
def edit(change):
    def make(tmp_path):
        raw = attempts_config()
        change(raw)
        return write(tmp_path, raw)
    return make


def faulty(fault):
    return edit(lambda raw: raw["environment"].update(name=f"{HERE / 'envs.py'}:FaultyAttemptsEnv",
                                                      kwargs={"fault": fault}))


CASES = {  # case: (config, command)
    "attempts_below_one": (edit(lambda raw: raw["roles"].update(attempts={"solver": 0})), "validate"),
    "attempts_role_unseated": (edit(lambda raw: raw["roles"].update(attempts={"judge": 2})), "validate"),
    "attempts_role_not_listed": (edit(lambda raw: raw["roles"].update(attempts={"proposer": 2})), "validate"),
    "eval_attempts_role_not_listed": (
        edit(lambda raw: raw.update(eval={"data": HELD_OUT, "attempts": {"proposer": 2}})), "validate"),
    "attempts_with_critic": (edit(lambda raw: raw.update(algorithm={"baseline": "critic"})), "validate"),
    "algorithm_agents_with_critic": (edit(lambda raw: raw.update(algorithm={"baseline": "critic", "agents": {
        "p": {"scale_rewards": False}}})), "validate"),
    "pass_k_beyond_attempts": (edit(lambda raw: raw.update(eval={"data": HELD_OUT, "pass_k": [4]})), "validate"),
    "env_attempts_not_positive": (faulty("attempts_zero"), "validate"),
    "env_attempt_rewards_miscounted": (faulty("rewards_short"), "run"),
    "env_attempt_infos_miscounted": (faulty("infos_short"), "run"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_attempts_get_one_line_and_exit_2(case, tmp_path, capsys):
    make, command = CASES[case]
    path = make(tmp_path)
    capsys.readouterr()
    code = main([command, str(path)] + (["--run-dir", str(tmp_path / "out")] if command == "run" else []))
    out = capsys.readouterr()
    assert code == 2 and out.err.count("\n") == 1 and out.err.startswith("marsi: error: "), out.err
    assert command == "run" or out.out == ""  # validate: refused before it prints anything
    assert_documented(case, out.err, exit=code, tmp=tmp_path)
    assert not (tmp_path / "out").exists()


def test_a_bad_k_is_refused_by_marsi_run_too(tmp_path, capsys):
    path = edit(lambda raw: raw["roles"].update(attempts={"proposer": 2}))(tmp_path)
    assert main(["run", str(path), "--run-dir", str(tmp_path / "out")]) == 2
    assert_documented("attempts_role_not_listed", capsys.readouterr().err, exit=2, tmp=tmp_path)
    assert not (tmp_path / "out").exists()


def test_a_vllm_agents_cache_holds_its_attempts_rows():
    raw = attempts_config()
    raw["roles"]["attempts"] = {"solver": 4}
    for agent in raw["agents"].values():
        agent["rollout"] = {"engine": "vllm"}
    config = validate_config(raw)
    sizes = plan_of(config).engine_cache_sizes
    assert sizes["s"] == 2 * 2 * 4  # batch_size x num_generations x k
    assert sizes["p"] == 2 * 2
    assert config.agents["s"].rollout.vllm.kv_cache_sequences is None  # the config stays as written


def test_algorithm_agents_names_defined_agents():
    raw = attempts_config(algorithm={"agents": {"zed": {"baseline": "ema"}}})
    with pytest.raises(Exception, match="algorithm.agents: agent 'zed' is not defined; defined agents: p, s"):
        validate_config(raw)


# ------------------------------------------------------------------------------- runs, through the CLI


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """3 steps on builtin:tiny through `marsi run`, 2 attempts per prompt (roles.attempts over the environment's 3),
    evaluated with pass@k over them, every episode's transcript kept; then `marsi report`. Both in the test's process
    (tests/inproc.py); their subprocess runs are in test_cli.py and test_report.py."""
    from tests.inproc import marsi

    tmp = tmp_path_factory.mktemp("attempts")
    raw = attempts_config(train={"steps": 3, "transcripts_per_step": 4},
                          eval={"data": HELD_OUT, "temperature": 1.0, "pass_k": [1, 2]})
    out = marsi("run", write(tmp, raw), "--run-dir", tmp / "run", "roles.attempts.solver=2")
    assert out.returncode == 0, out.stderr
    assert marsi("report", tmp / "run").returncode == 0
    return tmp / "run"


def test_a_run_through_the_cli_trains_both_roles_with_metrics_under_the_role(cli_run):
    metrics = rows(cli_run)
    train = [m for m in metrics if "reward/mean" in m]
    assert [m["step"] for m in train] == [1, 2, 3] and all(m["trained"] == ["p", "s"] for m in train)
    assert all({"reward/proposer", "reward/solver"} <= set(m) for m in train)
    assert not [k for m in metrics for k in m if "solver_" in k]
    episodes = [json.loads(line) for line in (cli_run / "transcripts.jsonl").read_text().splitlines()]
    assert len(episodes) == 3 * 4
    for e in episodes:
        proposer, solver = e["turns"]
        assert [a.get("attempt") for a in proposer["actions"]] == [None]
        assert [a["attempt"] for a in solver["actions"]] == [0, 1]
        assert len({a["prompt"] for a in solver["actions"]}) == 1 and len(solver["reward"]["solver"]) == 2
        assert e["reward"]["solver"] == pytest.approx(sum(solver["reward"]["solver"]) / 2)
        assert sum(a["advantage"] for a in solver["actions"]) == pytest.approx(0.0, abs=1e-6)  # centred within the k
    evaluations = [m for m in metrics if "eval/reward/mean" in m]
    assert [m["step"] for m in evaluations] == [0, 3]
    assert all(0.0 <= m["eval/pass@1/solver"] <= m["eval/pass@2/solver"] <= 1.0 for m in evaluations)


def test_validate_prints_the_attempts_of_each_seat(tmp_path, capsys):
    assert main(["validate", str(write(tmp_path, attempts_config()))]) == 0
    out = capsys.readouterr().out
    assert "xK the roles that answer each prompt K times" in out
    assert "episode 1: turn 1: proposer=p* solver=s x3 | turn 2: proposer=p solver=s* x3" in out


@pytest.mark.skipif(__import__("shutil").which("chromium") is None, reason="no chromium on PATH")
def test_the_report_shows_a_prompts_attempts_together(cli_run):
    from tests.test_report import chromium, console

    out = chromium("--dump-dom", (cli_run / "report.html").as_uri() + "#kind=train")
    assert out.returncode == 0 and console(out) == [], console(out)
    dom = out.stdout
    first = dom[dom.index('<details class="episode"'):]
    first = first[:first.index("</details>")]  # the first episode, opened
    assert "solver played by s (policy version 0), 2 attempts at one prompt" in first
    assert first.count('class="prompt"') == 2  # the proposer's prompt and the solver's, once
    assert "attempt 1: reward" in first and "attempt 2: reward" in first


def test_a_killed_asynchronous_run_with_attempts_resumes_to_the_same_metrics(tmp_path):
    """Schedule alternate, max_staleness 1: checkpoints keep rollouts played ahead, attempts and all; the coordinator is
    SIGKILLed after 2 steps, resumed, and ends with the metrics of a run never interrupted."""
    raw = attempts_config(schedule={"kind": "alternate"},
                          train={"steps": 4, "max_staleness": 1, "checkpoint_every": 1, "keep_checkpoints": 5})
    uninterrupted = uninterrupted_rows(validate_config(raw), tmp_path / "whole")
    assert [m["trained"] for m in uninterrupted] == [["p"], ["s"], ["p"], ["s"]]
    assert killed_and_resumed(write(tmp_path, raw), tmp_path / "run", 4) == uninterrupted


def test_a_custom_loop_of_adapter_agents_plays_and_trains_attempts():
    """The primitives a custom coordinator script uses, with the proposer and solver as adapters on one base."""
    raw = attempts_config(hosts={"h": {"resources": {"num_cpus": 0.5}}})
    for agent in raw["agents"].values():
        del agent["resources"]
        agent.update(host="h", adapter={"rank": 4, "alpha": 8})
    with Coordinator(validate_config(raw)) as coord:
        assert coord.attempts == {"solver": 3}
        episodes = coord.play(letters(2).to_list())
        experiences, _ = coord.advantages(episodes)
        assert [len(experiences[a]) for a in ("p", "s")] == [2 * 2, 2 * 2 * 3]  # 2 samples x 2 episodes (x 3)
        solver = [a.advantage for e in episodes for a in e.turns[1].actions]
        assert all(sum(solver[i:i + 3]) == pytest.approx(0.0, abs=1e-6) for i in range(0, 12, 3))
        results = coord.train(experiences)
    assert sorted(results) == ["p", "s"] and all(r.num_tokens > 0 for r in results.values())
