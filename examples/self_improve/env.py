"""Self-improvement (MAFT-style revise): one agent answers, then sees its own answer and revises it.

Turn 1: the agent answers a small arithmetic question ("What is 7 + 5?"). Turn 2: the environment
rewrites the prompt to show the agent its previous answer (and, with `show_verdict=True`, a verifier's
verdict "correct" / "incorrect") and asks for a revised final answer. The shared reward, paid on the
last turn, is 1.0 when the final answer is right: the last integer in the text equals the answer. With
discount 1 the first answer is credited with the final outcome too.

episode_info: `first_correct`, `final_correct` (first-turn vs final accuracy), and `changed` (the final
answer differs from the first).
"""

from __future__ import annotations

import random
import re

import datasets

from protocols.env import Environment, StepResult
from protocols.splits import arithmetic_rows

_INT = re.compile(r"-?[0-9]+")
_SHOWN = 200  # characters of the previous answer shown again in the revise prompt


def last_integer(text: str) -> int | None:
    """The last integer written in `text` (ASCII digits, optional minus), or None."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


class SelfImproveEnv(Environment):
    possible_agents = ["solver"]
    max_turns = 2

    def __init__(self, show_verdict: bool = True):
        self.show_verdict = show_verdict

    def reset(self, sample, seed=None):
        self.question, self.answer = sample["question"], int(sample["answer"])
        self.turn, self.first, self.final = 0, None, None
        return {"solver": f"{self.question} Reply with just the number."}

    def step(self, actions):
        text = actions["solver"]
        value = last_integer(text)
        infos = {} if value is not None else {"solver": {"invalid": True, "reason": "no integer in the answer"}}
        self.turn += 1
        if self.turn == 1:
            self.first = value
            shown = text.strip()[:_SHOWN] or "(empty)"
            lines = [self.question, "", f"Your previous answer was: {shown}"]
            if self.show_verdict:
                lines.append(f"A verifier checked it: {'correct' if value == self.answer else 'incorrect'}.")
            lines += ["", "Review your previous answer and revise it if needed. Reply with just the final number."]
            return StepResult(prompts={"solver": "\n".join(lines)}, reward=0.0, infos=infos)
        self.final = value
        return StepResult(prompts={}, reward=float(value == self.answer), terminated=True, infos=infos)

    def episode_info(self):
        return {"first_correct": float(self.first == self.answer), "final_correct": float(self.final == self.answer),
                "changed": float(self.first != self.final), "success": float(self.final == self.answer)}


def make_dataset(n: int = 256, seed: int = 0, max_operand: int = 9, ops: str = "+*",
                 split: str = "train") -> datasets.Dataset:
    """`n` questions "What is a <op> b?" (`protocols.splits.arithmetic_rows`: 1 <= a, b <= max_operand, a fixed
    seed, about one in five possible questions held out as `split: eval`)."""
    return datasets.Dataset.from_list(arithmetic_rows(n, seed, max_operand, ops, split))


def sample_action(role: str, prompt, rng: random.Random) -> str:
    """A well-formed random answer: a number, sometimes inside a sentence."""
    value = rng.randint(0, 90)
    return rng.choice([str(value), f"The answer is {value}."])
