"""The issue-4 example environments: check_env with their own well-formed actions, junk and empty
actions (check_env plays those itself), and rewards computed by hand."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from protocols.env_checker import check_env
from protocols.imports import import_object

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load(example: str, name: str):
    return import_object(f"{EXAMPLES / example / 'env.py'}:{name}")


@pytest.mark.parametrize("example, env_class, kwargs", [
    ("self_improve", "SelfImproveEnv", {}),
    ("self_improve", "SelfImproveEnv", {"show_verdict": False}),
    ("tictactoe", "TicTacToeEnv", {}),
    ("tictactoe", "TicTacToeEnv", {"opponent": "random"}),
    ("tictactoe", "TicTacToeEnv", {"opponent": "random", "agent_seat": "O"}),
    ("rsi", "RSIEnv", {}),
    ("rsi", "RSIEnv", {"reward": "r_zero"}),
    ("rsi", "RSIEnv", {"proposer": "fixed"}),
    ("debate", "DebateEnv", {}),
    ("debate", "DebateEnv", {"debaters": 3, "rounds": 2}),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={x}" for k, x in v.items()) or "default")
def test_check_env_with_sample_junk_and_empty_actions(example, env_class, kwargs):
    env = load(example, env_class)(**kwargs)
    samples = load(example, "make_dataset")().to_list()[:8]
    check_env(env, samples, action_fn=load(example, "sample_action"), episodes=8)
    check_env(env, samples, action_fn=lambda role, prompt, rng: rng.choice("abcd"))


def test_datasets_are_seeded():
    for example in ("self_improve", "tictactoe", "rsi", "debate"):
        make = load(example, "make_dataset")
        assert make(seed=3).to_list() == make(seed=3).to_list()
        assert make(seed=3).to_list() != make(seed=4).to_list()


# ------------------------------------------------------------------------------------ self_improve
def test_self_improve_rewards_the_final_answer_and_shows_the_verdict():
    env = load("self_improve", "SelfImproveEnv")(show_verdict=True)
    prompts = env.reset({"question": "What is 7 * 8?", "answer": 56})
    assert list(prompts) == ["solver"] and "What is 7 * 8?" in prompts["solver"]
    first = env.step({"solver": "It is 54."})
    assert first.reward == 0.0 and not first.terminated
    assert "It is 54." in first.prompts["solver"] and "incorrect" in first.prompts["solver"]
    last = env.step({"solver": "Sorry: 7 * 8 = 56"})  # the last integer counts
    assert last.reward == 1.0 and last.terminated and last.prompts == {}
    assert env.episode_info() == {"first_correct": 0.0, "final_correct": 1.0, "changed": 1.0, "success": 1.0}

    env = load("self_improve", "SelfImproveEnv")(show_verdict=False)
    env.reset({"question": "What is 2 + 3?", "answer": 5})
    revise = env.step({"solver": "5"}).prompts["solver"]
    assert "verifier" not in revise and "correct" not in revise
    last = env.step({"solver": "no idea"})
    assert last.reward == 0.0 and last.infos["solver"]["invalid"] and last.infos["solver"]["reason"]
    assert env.episode_info() == {"first_correct": 1.0, "final_correct": 0.0, "changed": 1.0, "success": 0.0}


# --------------------------------------------------------------------------------------- tictactoe
def test_tictactoe_win_gives_plus_one_to_the_winner_and_minus_one_to_the_loser():
    env = load("tictactoe", "TicTacToeEnv")()
    prompts = env.reset({"board": "........."})
    assert list(prompts) == ["X"]
    for role, cell in [("X", "1"), ("O", "4"), ("X", "2"), ("O", "5")]:
        result = env.step({role: f"I play {cell}"})
        assert result.reward == {"X": 0.0, "O": 0.0} and not result.terminated
        assert list(result.prompts) == ["O" if role == "X" else "X"]  # only the side to move acts
    result = env.step({"X": "3"})
    assert result.reward == {"X": 1.0, "O": -1.0} and result.terminated and result.prompts == {}
    assert env.episode_info() == {"legal_move_rate": 1.0, "moves": 5.0}


@pytest.mark.parametrize("text, reason", [("5", "not an empty cell"), ("hello", "no cell number"),
                                          ("", "no cell number"), ("10", "not an empty cell")])
def test_tictactoe_invalid_move_loses_for_the_mover(text, reason):
    env = load("tictactoe", "TicTacToeEnv")()
    env.reset({"board": "....X...."})  # X played the centre: O to move
    result = env.step({"O": text})
    assert result.terminated and result.reward == {"O": -1.0, "X": 1.0}
    assert result.infos["O"]["invalid"] and reason in result.infos["O"]["reason"]
    assert env.episode_info()["legal_move_rate"] == 0.0


def test_tictactoe_draw_is_zero_for_both():
    env = load("tictactoe", "TicTacToeEnv")()
    env.reset({"board": "XOXXOO.X."})  # O to move; O 7 then X 9 fills the board with no line
    assert env.step({"O": "7"}).reward == {"X": 0.0, "O": 0.0}
    result = env.step({"X": "9"})
    assert result.terminated and result.reward == {"X": 0.0, "O": 0.0}


def test_tictactoe_random_opponent_plays_the_other_seat():
    env = load("tictactoe", "TicTacToeEnv")(opponent="random", agent_seat="O")
    prompts = env.reset({"board": "........."}, seed=7)
    assert list(prompts) == ["O"] and env.board.count("X") == 1  # the environment moved first as X
    sample_action = load("tictactoe", "sample_action")
    rng, result = random.Random(0), None
    while True:
        result = env.step({"O": sample_action("O", prompts["O"], rng)})
        if result.terminated:
            break
        prompts = result.prompts
        assert list(prompts) == ["O"] and env.board.count("X") == env.board.count("O") + 1
    info = env.episode_info()
    assert info["legal_move_rate"] == 1.0 and info["win"] + info["draw"] + info["loss"] == 1.0
    assert info["win"] == float(result.reward["O"] > 0) and info["loss"] == float(result.reward["O"] < 0)
    assert info["success"] == info["win"]

    env = load("tictactoe", "TicTacToeEnv")(opponent="random", agent_seat="X")
    env.reset({"board": "........."}, seed=1)
    env.step({"X": "x marks the spot"})
    assert env.episode_info() == {"legal_move_rate": 0.0, "moves": 1.0, "win": 0.0, "draw": 0.0, "loss": 1.0,
                                  "success": 0.0}


# --------------------------------------------------------------------------------------------- rsi
@pytest.mark.parametrize("expression, value", [("3 + 4 * 2", 11), ("(3 + 4) * 2", 14), ("10 - 2 - 3", 5),
                                               ("-3 * -4", 12), ("2*(3+(4-1))", 12)])
def test_rsi_parser_evaluates_arithmetic(expression, value):
    assert load("rsi", "evaluate")(expression)[0] == value


@pytest.mark.parametrize("expression", ["__import__('os')", "2 ** 10", "3 / 4", "1 +", "(1 + 2", "1 2", "",
                                        "9" * 40, "1+" * 70 + "1"])
def test_rsi_parser_rejects_everything_else(expression):
    with pytest.raises(load("rsi", "ParseError")):
        load("rsi", "evaluate")(expression)


SEED = {"a": 7, "b": 3, "op": "+"}


def rsi_episode(proposal: str, attempts: list[str], **kwargs):
    """(turn-1 result, turn-2 result or None, episode_info) of one RSI episode played alone."""
    env = load("rsi", "RSIEnv")(**kwargs)
    env.reset(SEED, seed=0)
    first = env.step({"proposer": proposal})
    last = None if first.terminated else env.step({"solver": attempts})
    return first, last, env.episode_info()


@pytest.mark.parametrize("reward, p, paid", [
    ("absolute_zero", 0.25, 0.75), ("absolute_zero", 0.0, 0.0), ("absolute_zero", 1.0, 0.0),
    ("r_zero", 0.25, 0.25), ("r_zero", 0.5, 0.5), ("r_zero", 1.0, 0.0),
    ("cooperative", 0.25, 0.625), ("cooperative", 0.0, 0.5),
])
def test_rsi_proposer_is_paid_from_the_solvers_success_over_its_attempts(reward, p, paid):
    right = round(4 * p)
    attempts = ["Answer: 13"] * right + ["Answer: 12"] * (4 - right)  # 3 + 5 * 2 = 13
    first, last, info = rsi_episode("Problem: 3 + 5 * 2", attempts, reward=reward)
    assert first.reward == {"proposer": 0.0} and first.prompts == {
        "solver": "Compute 3 + 5 * 2. Give the result as a single integer on one line, in the form Answer: <number>"}
    assert last.terminated and last.reward == {"proposer": pytest.approx(paid), "solver": [1.0] * right + [0.0] * (4 - right)}
    assert info["valid_problem"] == 1.0 and info["solver_success"] == p and info["problem_size"] == 2.0


def test_rsi_solver_answer_is_its_answer_line_else_its_last_integer_and_the_format_is_reported_apart():
    attempts = ["Answer: 42", "6 * 7 = 42", "Answer: 40, no: 42", "", "answer:42 done"]
    _, last, info = rsi_episode("Problem: 6 * 7 = 42", attempts)
    assert last.reward["solver"] == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert [a.get("invalid", False) for a in last.infos["solver"]["attempts"]] == [False, False, False, True, False]
    assert info["format_valid"] == 0.6 and info["strict_correct"] == 0.4 and info["solver_success"] == 0.6


@pytest.mark.parametrize("proposal, why", [
    ("", "no 'Problem:' line"), ("7 + 3", "no 'Problem:' line"), ("Problem: 2 ** 3", "does not parse"),
    ("Problem: 12", "no operator"), ("Problem: 1 + 2 + 3 + 4", "3 operators; at most 2"),
    ("Problem: 21 + 1", "a number above 20"), ("Problem: (2 + 3) * 4 - 1", "3 operators"),
])
def test_rsi_invalid_or_oversized_problems_end_the_episode_with_the_penalty(proposal, why):
    first, last, info = rsi_episode(proposal, [])
    assert first.terminated and last is None and first.reward == {"proposer": -0.5}
    assert first.infos["proposer"]["invalid"] and why in first.infos["proposer"]["reason"]
    assert info == {"valid_problem": 0.0}


def test_rsi_duplicates_within_a_batch_are_penalised_every_copy():
    env = load("rsi", "RSIEnv")
    batch, shared = [env() for _ in range(3)], {}
    for e in batch:  # one batch, as the rollout loop gives it (`Environment.batch`)
        e.batch = shared
        e.reset(SEED, seed=0)
    for e, problem in zip(batch, ["3 + 4", "3+4", "5 * 2"]):  # all turn 1s before any turn 2, as the rollout loop
        assert e.step({"proposer": f"Problem: {problem}"}).prompts
    half = ["Answer: 7", "Answer: 0"] * 2
    rewards = [e.step({"solver": half}).reward["proposer"] for e in batch[:2]]
    assert rewards == [0.0, 0.0]  # learnability 0.5 - 0.5 for each copy
    assert batch[2].step({"solver": ["Answer: 10", "Answer: 0"] * 2}).reward["proposer"] == 0.5
    assert [e.episode_info()["distinct"] for e in batch] == [0.5, 0.5, 1.0]
    first, _, info = rsi_episode("Problem: 3 + 4", half)  # an episode outside a batch is a batch of its own
    assert info["distinct"] == 1.0


def test_rsi_training_data_are_prompt_seeds_and_the_held_out_sets_are_fixed_graded_and_labelled():
    make, evaluate = load("rsi", "make_dataset"), load("rsi", "evaluate")
    train = make(n=64, seed=5).to_list()
    assert all(set(row) == {"a", "b", "op"} for row in train)  # no problem, no answer
    held, ood = make(split="eval").to_list(), make(split="ood").to_list()
    assert held == make(split="eval", seed=9).to_list() and len(held) == 210 and len(ood) == 80
    assert [sum(r["level"] == k for r in held) for k in (1, 2, 3)] == [70, 70, 70]
    assert all(evaluate(r["problem"])[0] == r["answer"] for r in held + ood)
    operators, numbers = load("rsi", "operators"), lambda r: evaluate(r["problem"])[1]
    assert all(operators(r["problem"]) == {1: 1, 2: 1, 3: 2}[r["level"]] for r in held)
    assert all(max(numbers(r)) <= {1: 10, 2: 20, 3: 10}[r["level"]] for r in held)
    assert all(min(numbers(r)) > 20 or operators(r["problem"]) == 3 for r in ood)  # beyond the training cap
    assert len({r["problem"] for r in held}) > 150


def test_rsi_held_out_episode_is_the_solver_alone_scored_by_accuracy():
    env = load("rsi", "RSIEnv")()
    sample = load("rsi", "make_dataset")(split="eval")[0]
    prompts = env.reset(sample, seed=0)
    assert list(prompts) == ["solver"] and sample["problem"] in prompts["solver"]
    answer = sample["answer"]
    last = env.step({"solver": [f"Answer: {answer}", str(answer), "Answer: -1", "Answer: 1000"]})
    assert last.terminated and last.reward == 0.5  # reward/mean is the held-out accuracy
    assert env.episode_info() == {"accuracy": 0.5, "accuracy_level1": 0.5, "format_valid": 0.75,
                                  "strict_correct": 0.25}
    for split in ("eval", "ood"):
        check_env(env, load("rsi", "make_dataset")(split=split).to_list()[:8], action_fn=load("rsi", "sample_action"))


def test_rsi_fixed_generator_writes_the_problem_itself():
    env = load("rsi", "RSIEnv")(proposer="fixed")
    assert env.possible_agents == ["solver"]
    assert env.reset(SEED, seed=3) != env.reset(SEED, seed=4)
    prompts = env.reset(SEED, seed=3)
    assert list(prompts) == ["solver"] and prompts == env.reset(SEED, seed=3)
    value = load("rsi", "evaluate")(prompts["solver"].split(". Give")[0].removeprefix("Compute "))[0]
    last = env.step({"solver": [f"Answer: {value}", "Answer: x", "", f"Answer: {value}"]})
    assert last.reward == {"solver": [1.0, 0.0, 0.0, 1.0]} and env.episode_info()["solver_success"] == 0.5


def test_rsi_attempts_share_one_prompt_and_their_advantages_are_centred_within_the_k():
    from orchestrator import rollout
    from orchestrator.baselines import experiences_by_agent
    from protocols.config import AlgorithmConfig
    from protocols.messages import Completion

    calls = []

    def generate(prompts, seed):
        calls.append(prompts)
        texts = {"teacher": ["Problem: 2 + 3", "Problem: 4 * 4"],
                 "student": ["Answer: 5", "Answer: 6", "Answer: 5", "6", "Answer: 16"] + ["Answer: 1"] * 3}
        return {agent: [Completion(text=texts[agent][i], prompt_ids=[1], completion_ids=[2], per_token_logps=[-0.1],
                                   finish_reason="stop") for i in range(len(ps))] for agent, ps in prompts.items()}

    env = import_object(f"{EXAMPLES / 'rsi' / 'env.py'}:RSIEnv")
    episodes = rollout.play(env, [SEED], 2, lambda e, t: {"proposer": "teacher", "solver": "student"}, generate,
                            seed=0, first_episode=0)
    solver_prompts = calls[1]["student"]
    assert solver_prompts[:4] == [solver_prompts[0]] * 4 and solver_prompts[4:] == [solver_prompts[4]] * 4
    assert "2 + 3" in solver_prompts[0] and "4 * 4" in solver_prompts[4]
    out = experiences_by_agent(episodes, AlgorithmConfig(scale_rewards=False), {})
    # p = 1/2 and 1/4: the student's advantages are its rewards less each problem's mean
    assert [e.advantage for e in out["student"]] == pytest.approx([0.5, -0.5, 0.5, -0.5, 0.75, -0.25, -0.25, -0.25])
    # the teacher's: learnability 0.5 and 0.75 centred over the sample's two episodes
    assert [e.advantage for e in out["teacher"]] == pytest.approx([-0.125, 0.125])


# ------------------------------------------------------------------------------------------ debate
def test_debate_majority_score():
    majority_correct = load("debate", "majority_correct")
    assert majority_correct([5, 5], 5) == 1.0
    assert majority_correct([5, 4], 5) == 0.5
    assert majority_correct([4, 4], 5) == 0.0
    assert majority_correct([5, 5, 4], 5) == 1.0
    assert majority_correct([5, 4, 3], 5) == pytest.approx(1 / 3)
    assert majority_correct([5, None], 5) == 1.0  # a reply without a number casts no vote
    assert majority_correct([None, None], 5) == 0.0


def test_debate_agents_see_each_other_and_the_final_majority_is_rewarded():
    env = load("debate", "DebateEnv")(debaters=3)
    prompts = env.reset({"question": "What is 6 * 7?", "answer": 42})
    assert set(prompts) == {"debater1", "debater2", "debater3"}
    first = env.step({"debater1": "42", "debater2": "It is 41", "debater3": ""})
    assert first.reward == 0.0 and not first.terminated and first.infos["debater3"]["invalid"]
    assert "It is 41" in first.prompts["debater1"] and "(no answer)" in first.prompts["debater1"]
    assert "Your previous answer: 42" in first.prompts["debater1"]
    last = env.step({"debater1": "42", "debater2": "You are right, 42", "debater3": "41"})
    assert last.reward == 1.0 and last.terminated
    info = env.episode_info()
    assert info["first_majority_correct"] == 0.5 and info["final_majority_correct"] == 1.0
    assert info["first_accuracy"] == pytest.approx(1 / 3) and info["final_accuracy"] == pytest.approx(2 / 3)
