"""Baselines: how an agent's returns become advantages, one strategy per `algorithm.baseline`.

A strategy (`orchestrator.baseline.Baseline`) gets one agent's scored actions of a batch (`advantages.scored_actions`: each one's
return, its group and its seat) and answers each action's advantage. `strategies()` names every strategy a
config may choose for an agent (`algorithm.baseline`, or its own under `algorithm.agents`); `baseline_for`
looks one up, once per agent and batch; `experiences_by_agent` scores a batch's episodes with them. The maths of
each: `orchestrator.advantages` and docs/rl-maths.md.

`critic` is not among them: its advantages need the critics' values of every state, so a run with
`algorithm.baseline: critic` scores its batches through `orchestrator.credit` instead (`uses_critic`).

A new baseline is one file with one `Baseline` subclass (`orchestrator/baseline_rloo.py` is one), named in
`strategies()` below and in the `baseline` Literals of `protocols/config/algorithm.py`.
"""

from __future__ import annotations

import functools

from orchestrator.advantages import Baselines, ema_advantages, group_relative_advantages, scored_actions
from orchestrator.baseline import Baseline
from orchestrator.baseline_rloo import RlooBaseline
from orchestrator.rollout import Episode
from protocols.config import AlgorithmConfig
from protocols.messages import Experience


class GroupBaseline(Baseline):
    """GRPO: each return minus its group's mean, divided by the group's std when `scale_rewards`."""

    name = "group"

    def advantages(self, agent, returns, groups, seats, algorithm, kept):
        return group_relative_advantages(returns, groups, scale=algorithm.scale_rewards)


class EmaBaseline(Baseline):
    """SPIRAL's role-conditioned advantages: each return minus a moving average kept per (agent, role, turn),
    which the batch's returns then update."""

    name = "ema"

    def advantages(self, agent, returns, groups, seats, algorithm, kept):
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
    """Name -> strategy: every baseline a config may choose for an agent (made once, on first use)."""
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


def experiences_by_agent(episodes: list[Episode], algorithm: AlgorithmConfig,
                         baselines: Baselines) -> dict[str, list[Experience]]:
    """Every action as an Experience with its advantage, grouped by agent; each action's `advantage` is set too
    (its transcript shows it), by each agent's baseline strategy (`baseline_for`). `baselines` is updated
    in place for the agents whose baseline is `ema`."""
    actions, returns, keys, seats = scored_actions(episodes, algorithm)
    if not actions:
        return {}
    advantages = [0.0] * len(actions)
    for agent in dict.fromkeys(a.agent for a in actions):
        own = algorithm.for_agent(agent)
        mine = [i for i, a in enumerate(actions) if a.agent == agent]
        scored = baseline_for(own).advantages(agent, [returns[i] for i in mine], [keys[i] for i in mine],
                                              [seats[i] for i in mine], own, baselines)
        for i, a in zip(mine, scored):
            advantages[i] = a
    out: dict[str, list[Experience]] = {}
    for action, advantage in zip(actions, advantages):
        action.advantage = advantage  # kept on the action for its transcript
        out.setdefault(action.agent, []).append(Experience.from_completion(action.completion, advantage))
    return out
