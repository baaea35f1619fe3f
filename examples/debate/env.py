"""Debate (MAFT-style): two or three agents answer an arithmetic question, see each other's answers,
and may revise.

Turn 1: every debater answers the question. Each later turn (`rounds` of them, default 1): every
debater sees its own previous answer and the others' and gives a final answer. An answer is the last
integer of the reply; a reply without one casts no vote (and is reported invalid). The shared reward,
paid on the last turn, is the correctness of the final majority answer: 1 when the right answer is the
single most common one, 1/k when it ties with k-1 other answers for most common (a random tie-break's
expected correctness), else 0. With two debaters that is 1 when both are right, 0.5 when one is.

episode_info: `first_majority_correct`, `final_majority_correct` (the same score on the first and the
final answers), `first_accuracy`, `final_accuracy` (fraction of debaters right).
"""

from __future__ import annotations

import random
import re
from collections import Counter

import datasets

from protocols.env import Environment, StepResult
from protocols.splits import arithmetic_rows

_INT = re.compile(r"-?[0-9]+")
_SHOWN = 200  # characters of an answer shown to the other debaters


def last_integer(text: str) -> int | None:
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def majority_correct(answers: list[int | None], target: int) -> float:
    """Expected correctness of the most common answer (ties broken at random); None casts no vote."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    leaders = [a for a, c in votes.items() if c == top]
    return 1.0 / len(leaders) if target in leaders else 0.0


class DebateEnv(Environment):
    def __init__(self, debaters: int = 2, rounds: int = 1):
        if debaters < 2 or rounds < 1:
            raise ValueError(f"need debaters >= 2 and rounds >= 1, got debaters={debaters}, rounds={rounds}")
        self.possible_agents = [f"debater{i + 1}" for i in range(debaters)]
        self.rounds = rounds
        self.max_turns = 1 + rounds

    def reset(self, sample, seed=None):
        self.question, self.answer = sample["question"], int(sample["answer"])
        self.turn, self.history = 0, []  # history: per turn, role -> (text, value)
        return {r: f"{self.question} Reply with just the number." for r in self.possible_agents}

    def step(self, actions):
        said = {r: (actions.get(r, ""), last_integer(actions.get(r, ""))) for r in self.possible_agents}
        self.history.append(said)
        self.turn += 1
        infos = {r: {"invalid": True, "reason": "no integer in the answer"} for r, (_, v) in said.items() if v is None}
        if self.turn >= self.max_turns:
            score = majority_correct([v for _, v in said.values()], self.answer)
            return StepResult(prompts={}, reward=score, terminated=True, infos=infos)
        return StepResult(prompts={r: self._revise_prompt(r, said) for r in self.possible_agents}, reward=0.0,
                          infos=infos)

    def episode_info(self):
        first, final = self.history[0], self.history[-1]
        values = lambda said: [v for _, v in said.values()]  # noqa: E731
        n = len(self.possible_agents)
        return {"first_majority_correct": majority_correct(values(first), self.answer),
                "final_majority_correct": majority_correct(values(final), self.answer),
                "first_accuracy": sum(v == self.answer for v in values(first)) / n,
                "final_accuracy": sum(v == self.answer for v in values(final)) / n}

    def _revise_prompt(self, role: str, said: dict) -> str:
        show = lambda text: text.strip()[:_SHOWN] or "(no answer)"  # noqa: E731
        others = [f"- Agent {i + 1}: {show(said[r][0])}" for i, r in enumerate(self.possible_agents) if r != role]
        return "\n".join([self.question, "", f"Your previous answer: {show(said[role][0])}",
                          "The other agents answered:", *others, "",
                          "Considering their answers, give your final answer. Reply with just the number."])


def make_dataset(n: int = 256, seed: int = 0, max_operand: int = 9, ops: str = "+*",
                 split: str = "train") -> datasets.Dataset:
    """`n` questions "What is a <op> b?" (`protocols.splits.arithmetic_rows`: 1 <= a, b <= max_operand, a fixed
    seed, about one in five possible questions held out as `split: eval`)."""
    return datasets.Dataset.from_list(arithmetic_rows(n, seed, max_operand, ops, split))


def sample_action(role: str, prompt, rng: random.Random) -> str:
    """A well-formed random answer: a number, sometimes inside a sentence."""
    value = rng.randint(0, 90)
    return rng.choice([str(value), f"I think it is {value}."])
