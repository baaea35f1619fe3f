"""The plain learning loop the trainer tests share: each prompt asks for a letter, saying it earns 1, advantages
are group-relative over the completions of one prompt."""

from __future__ import annotations

import random
from typing import Callable

from orchestrator.advantages import group_relative_advantages
from protocols.messages import Experience, GenerateRequest, GenerateResult, UpdateRequest


def say_the_letter_curve(generate: Callable[[GenerateRequest], GenerateResult], update: Callable[[UpdateRequest], object],
                         steps: int, *, group: int = 8, batch: int = 8, seed: int = 0) -> list[float]:
    """Mean reward of each of `steps` steps of `batch` prompts x `group` completions; prints it per tenth."""
    rng, curve = random.Random(seed), []
    for step in range(steps):
        prompts = [f"Say {t}" for t in [rng.choice("abcd") for _ in range(batch)] for _ in range(group)]
        result = generate(GenerateRequest(prompts=prompts, seed=step))
        rewards = [float(c.text[:1] == p[-1]) for c, p in zip(result.completions, prompts)]
        advantages = group_relative_advantages(rewards, [i // group for i in range(len(prompts))])
        update(UpdateRequest(experiences=[Experience.from_completion(c, a) for c, a in zip(result.completions, advantages)]))
        curve.append(sum(rewards) / len(rewards))
    tenth = max(1, steps // 10)
    print("reward curve (mean per tenth):", [round(sum(curve[i:i + tenth]) / tenth, 2) for i in range(0, steps, tenth)])
    return curve
