"""Relay: a speaker and a listener, two distinct agents, share one reward.

Turn 1: the speaker is told a letter ("Say c") and answers. Turn 2: the listener hears only the
speaker's first character ("Say <it>") and answers. Each turn pays 0.5 when its answer starts with
the original letter, so the team scores 1.0 when the speaker says the letter and the listener relays
it. The listener can only score when the speaker was right: the agents depend on each other.
"""

from __future__ import annotations

import datasets

from protocols.env import Environment, StepResult


class RelayEnv(Environment):
    possible_agents = ["speaker", "listener"]
    max_turns = 2

    def reset(self, sample, seed=None):
        self.target, self.said = sample["target"], {}
        return {"speaker": f"Say {self.target}"}

    def step(self, actions):
        role = "speaker" if "speaker" in actions else "listener"
        text = actions[role]
        first = text[:1]
        self.said[role] = first
        infos = {role: {"invalid": True, "reason": "empty answer"}} if not first else {}
        reward = 0.5 * (first == self.target)
        if role == "speaker":
            return StepResult(prompts={"listener": f"Say {first}"}, reward=reward, infos=infos)
        return StepResult(prompts={}, reward=reward, terminated=True, infos=infos)

    def episode_info(self):
        return {f"{role}_correct": float(self.said.get(role) == self.target) for role in self.possible_agents}


def make_dataset(letters: str = "abcd", repeats: int = 16) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"target": ch} for ch in letters * repeats])
