"""The sparse multi-turn task of benchmarks/critic_credit.py: two agents take turns, and only the end pays.

Roles `a` and `b` act in turn (a, b, a, b, ...) for `turns` turns. On each turn the acting role sees a row
of dots with the sample's letter in it (a new row each turn, as the demo's speaker does) and should say the
letter. Nothing is paid until the last turn, which pays the fraction of the turns answered right: a
4-turn episode's reward is 0, 0.25, ..., 1.0, all of it on turn 4. Under group baselines every action of an
episode is scored by that one end reward, so an action's own quarter is buried under the other three
turns' luck; a critic that has seen the earlier turns can take their part out.
"""

from __future__ import annotations

import random

import datasets

from protocols.env import Environment, StepResult

DOT = "."


class TakeTurnsEnv(Environment):
    possible_agents = ["a", "b"]

    def __init__(self, turns: int = 4):
        self.max_turns = turns

    def reset(self, sample, seed=None):
        self.letter, self.rows, self.turn, self.hits = sample["letter"], sample["rows"], 0, 0
        return {"a": self.rows[0]}

    def step(self, actions):
        (role, text), = actions.items()
        right = text[:1] == self.letter
        self.hits += right
        self.turn += 1
        infos = {role: {"invalid": True, "reason": "empty answer"}} if not text else {}
        if self.turn == self.max_turns:
            return StepResult(prompts={}, reward=self.hits / self.max_turns, terminated=True, infos=infos)
        return StepResult(prompts={"ab"[self.turn % 2]: self.rows[self.turn]}, reward=0.0, infos=infos)

    def episode_info(self):
        return {"hits": float(self.hits)}


def make_dataset(turns: int = 4, letters: str = "abcd", lengths: tuple[int, ...] = (1, 2, 3, 4), n: int = 64,
                 seed: int = 0) -> datasets.Dataset:
    """`n` samples, the letters in turn, each with one row of dots per turn holding the letter somewhere."""
    rng = random.Random(seed)

    def row(letter: str) -> str:
        cells = [DOT] * rng.choice(list(lengths))
        cells[rng.randrange(len(cells))] = letter
        return "".join(cells)

    return datasets.Dataset.from_list([{"letter": letters[i % len(letters)],
                                        "rows": [row(letters[i % len(letters)]) for _ in range(turns)]}
                                       for i in range(n)])
