"""RLOO: the leave-one-out baseline (Ahmadian et al., 2024, "Back to Basics: Revisiting REINFORCE Style
Optimization for Learning from Human Feedback in LLMs"; Kool et al., 2019). Each return's baseline is the mean
of the OTHER returns of its group: A_i = R_i - (sum_{j != i} R_j) / (n - 1) = n / (n - 1) * (R_i - mean(R)).

Groups are GRPO's (`algorithm.group_by`, and the k attempts of a role at one prompt), so RLOO and `group`
compare the same actions. Departures: groups may differ in size (episodes that ended early); a group of one has
no other return and gets advantage 0; returns are never divided by a std (`scale_rewards` does not apply).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence

from orchestrator.baseline import Baseline


def leave_one_out_advantages(returns: Sequence[float], group_ids: Sequence[Hashable]) -> list[float]:
    """Per return: itself minus the mean of the other returns of its group (0 in a group of one)."""
    total: dict[Hashable, float] = defaultdict(float)
    size: dict[Hashable, int] = defaultdict(int)
    for r, group in zip(returns, group_ids, strict=True):
        total[group] += float(r)
        size[group] += 1
    return [float(r) - (total[g] - float(r)) / (size[g] - 1) if size[g] > 1 else 0.0
            for r, g in zip(returns, group_ids)]


class RlooBaseline(Baseline):
    name = "rloo"

    def advantages(self, agent, returns, groups, seats, algorithm, kept):
        return leave_one_out_advantages(returns, groups)
