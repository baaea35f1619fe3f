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
    ("rsi", "RSIEnv", {"verifier": True}),
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


SAMPLE = {"number": 7, "a": 3, "b": 2}


def test_rsi_valid_problem_and_right_solver_scores_one():
    env = load("rsi", "RSIEnv")()
    prompts = env.reset(SAMPLE)
    assert list(prompts) == ["proposer"] and "number 7" in prompts["proposer"]
    first = env.step({"proposer": "Problem: 7 * 3 - 2\nAnswer: 19"})
    assert first.reward == 0.5 and first.prompts == {"solver": "Solve: 7 * 3 - 2\nReply with just the number."}
    last = env.step({"solver": "That is 19"})
    assert last.reward == 0.5 and last.terminated
    assert env.episode_info() == {"parsed": 1.0, "valid_problem": 1.0, "solver_correct": 1.0}


@pytest.mark.parametrize("proposal, first_reward, why", [
    ("Problem: 7 * 3 - 2 = 19", 0.5, None),             # the answer after '=' counts too
    ("Problem: 7 * 3 - 2\nAnswer: 20", 0.0, "stated answer 20"),
    ("Problem: 5 * 3\nAnswer: 15", 0.0, "does not use the number 7"),
    ("Problem: 7 + 1\nAnswer: 8", 0.0, "trivial"),
    ("Problem: 7 * 3", 0.0, "no 'Answer"),
])
def test_rsi_validity(proposal, first_reward, why):
    env = load("rsi", "RSIEnv")()
    env.reset(SAMPLE)
    first = env.step({"proposer": proposal})
    assert first.reward == first_reward and not first.terminated
    assert first.infos["proposer"]["valid"] == (why is None)
    if why:
        assert any(why in r for r in first.infos["proposer"]["reasons"])
    last = env.step({"solver": str(load("rsi", "evaluate")(proposal.split(":")[1].split("\n")[0].split("=")[0])[0])})
    assert last.reward == (0.5 if why is None else 0.0)  # the solver scores only on a valid problem
    assert env.episode_info()["solver_correct"] == 1.0


@pytest.mark.parametrize("proposal", ["", "Problem: import os", "Problem: 7 ** 2\nAnswer: 49", "7 + 3 = 10"])
def test_rsi_unparseable_problem_ends_with_zero(proposal):
    env = load("rsi", "RSIEnv")()
    env.reset(SAMPLE)
    result = env.step({"proposer": proposal})
    assert result.terminated and result.reward == 0.0 and result.infos["proposer"]["invalid"]
    assert env.episode_info() == {"parsed": 0.0, "valid_problem": 0.0, "solver_correct": 0.0}


def test_rsi_verifier_shares_the_reward_in_thirds():
    env = load("rsi", "RSIEnv")(verifier=True)
    env.reset(SAMPLE)
    first = env.step({"proposer": "Problem: 7 + 3\nAnswer: 11"})  # wrong stated answer: not valid
    assert first.reward == 0.0 and set(first.prompts) == {"solver", "verifier"}
    assert "Proposed answer: 11" in first.prompts["verifier"]
    last = env.step({"solver": "10", "verifier": "No, it is wrong."})
    assert last.reward == pytest.approx(1 / 3)  # only the verifier's third: its "no" is right
    assert env.episode_info() == {"parsed": 1.0, "valid_problem": 0.0, "solver_correct": 1.0, "verifier_correct": 1.0}

    env.reset(SAMPLE)
    assert env.step({"proposer": "Problem: 7 + 3\nAnswer: 10"}).reward == pytest.approx(1 / 3)
    assert env.step({"solver": "10", "verifier": "yes"}).reward == pytest.approx(2 / 3)


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
