"""Baselines: how an agent's returns become advantages, one strategy per `algorithm.baseline`.

A strategy (`Baseline`) gets one agent's scored actions of a batch (`advantages.scored_actions`: each one's
return, its group and its seat) and answers each action's advantage. `strategies()` names every strategy a
config may choose for an agent (`algorithm.baseline`, or its own under `algorithm.agents`); `baseline_for`
looks one up, once per agent and batch. The maths of each: `orchestrator.advantages` and docs/rl-maths.md.

`critic` is not among them: its advantages need the critics' values of every state, so a run with
`algorithm.baseline: critic` scores its batches through `orchestrator.credit` instead (`uses_critic`).

A new baseline is one file with one `Baseline` subclass (`orchestrator/baseline_rloo.py` is one), named in
`strategies()` below and in the `baseline` Literals of `protocols/config/algorithm.py`.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Hashable
from typing import ClassVar

from protocols.config import AlgorithmConfig

Baselines = dict[str, dict[str, dict[str, float]]]
"""EMA baseline per agent, then role, then turn (counted from 1, as a string: it is saved as JSON)."""

Seat = tuple[str, str, str]
"""(agent, role, turn counted from 1 as a string)."""


class Baseline(abc.ABC):
    """One agent's advantages from its returns. `kept` holds what a strategy carries from batch to batch (saved in
    checkpoints with the coordinator's state; only `ema` keeps anything)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def advantages(self, agent: str, returns: list[float], groups: list[Hashable], seats: list[Seat],
                   algorithm: AlgorithmConfig, kept: Baselines) -> list[float]:
        """The advantage of each of `agent`'s actions, given each one's return, group and seat, in that order;
        `algorithm` is the agent's own settings (`AlgorithmConfig.for_agent`)."""


class GroupBaseline(Baseline):
    """GRPO: each return minus its group's mean, divided by the group's std when `scale_rewards`."""

    name = "group"

    def advantages(self, agent, returns, groups, seats, algorithm, kept):
        from orchestrator.advantages import group_relative_advantages

        return group_relative_advantages(returns, groups, scale=algorithm.scale_rewards)


class EmaBaseline(Baseline):
    """SPIRAL's role-conditioned advantages: each return minus a moving average kept per (agent, role, turn),
    which the batch's returns then update."""

    name = "ema"

    def advantages(self, agent, returns, groups, seats, algorithm, kept):
        from orchestrator.advantages import ema_advantages

        out = [0.0] * len(returns)
        for seat in dict.fromkeys(seats):
            _, role, turn = seat
            idx = [i for i, s in enumerate(seats) if s == seat]
            mine = kept.setdefault(agent, {}).setdefault(role, {})
            adv, mine[turn] = ema_advantages(mine.get(turn, 0.0), [returns[i] for i in idx], algorithm.ema_decay)
            for i, a in zip(idx, adv):
                out[i] = a
        return out


CRITIC = "critic"
"""`algorithm.baseline: critic`: GAE against the critics' values (`orchestrator.credit`), not a `Baseline`."""


@functools.cache
def strategies() -> dict[str, Baseline]:
    """Name -> strategy: every baseline a config may choose for an agent (made once, on first use: a
    strategy's own file imports `Baseline` from here)."""
    from orchestrator.baseline_rloo import RlooBaseline

    return {b.name: b for b in (GroupBaseline(), EmaBaseline(), RlooBaseline())}


def baseline_for(algorithm: AlgorithmConfig) -> Baseline:
    """The strategy `algorithm.baseline` names (`algorithm`: one agent's settings)."""
    try:
        return strategies()[algorithm.baseline]
    except KeyError:
        raise ValueError(f"algorithm.baseline: {algorithm.baseline!r} is scored per batch by "
                         f"{'orchestrator.credit' if algorithm.baseline == CRITIC else 'no strategy'}; "
                         f"baselines: {', '.join(strategies())}") from None


def uses_critic(algorithm: AlgorithmConfig) -> bool:
    """Whether a run's advantages come from its critics (`orchestrator.credit`) rather than a `Baseline`."""
    return algorithm.baseline == CRITIC

