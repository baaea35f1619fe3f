"""Relay: a speaker and a listener, two distinct agents, share one reward.

Turn 1: the speaker sees a short row of dots with one letter in it (`..c.`) and answers. Turn 2: the
listener sees the speaker's first character placed in a row of dots of its own (`.c..`) and answers.
The speaker's turn pays 0.5 when its answer starts with the letter; the listener's pays 0.5 when its
answer starts with the letter and the speaker's did too. So the team scores 1.0 only when both are
right, and the listener cannot score by decoding a code of the speaker's: only by relaying a right answer.

The held-out split is positions and lengths: training rows are 1 to 4 characters long, evaluation rows
6 to 8, so the letter sits at positions no training row has. A table from prompt to answer cannot reach
them; the rule both agents need, "say the one character that is not a dot", does.
"""

from __future__ import annotations

import random

import datasets

from protocols.env import Environment, StepResult

DOT = "."
SLOT = "?"
"""Where the speaker's answer goes in the listener's row."""


class RelayEnv(Environment):
    possible_agents = ["speaker", "listener"]
    max_turns = 2

    def reset(self, sample, seed=None):
        self.letter, self.listener_row, self.said = sample["letter"], sample["listener"], {}
        return {"speaker": sample["speaker"]}

    def step(self, actions):
        role = "speaker" if "speaker" in actions else "listener"
        first = actions[role][:1]
        self.said[role] = first
        infos = {role: {"invalid": True, "reason": "empty answer"}} if not first else {}
        if role == "speaker":
            reward = 0.5 * (first == self.letter)
            return StepResult(prompts={"listener": self.listener_row.replace(SLOT, first or DOT)}, reward=reward,
                              infos=infos)
        reward = 0.5 * (first == self.letter == self.said["speaker"])
        return StepResult(prompts={}, reward=reward, terminated=True, infos=infos)

    def episode_info(self):
        return {f"{role}_correct": float(self.said.get(role) == self.letter) for role in self.possible_agents}


def make_dataset(letters: str = "abcd", lengths: tuple[int, ...] = (1, 2, 3, 4), n: int = 64,
                 seed: int = 0) -> datasets.Dataset:
    """`n` rows, the letters in turn: `speaker`, a row of dots of a length from `lengths` with the letter at a
    random position; `listener`, another such row with `?` where the speaker's answer will go."""
    rng = random.Random(seed)

    def row(mark: str) -> str:
        cells = [DOT] * rng.choice(list(lengths))
        cells[rng.randrange(len(cells))] = mark
        return "".join(cells)

    return datasets.Dataset.from_list([{"letter": letters[i % len(letters)], "speaker": row(letters[i % len(letters)]),
                                        "listener": row(SLOT)} for i in range(n)])


def sample_action(role: str, prompt, rng: random.Random) -> str:
    """A random answer: one of the prompt's characters (what `marsi validate`'s trial episode plays)."""
    return rng.choice(prompt)
