"""Bounded staleness of asynchronous rollouts: how far rollouts run ahead, which actions an update may use,
and the staleness and overlap figures a step logs. Plain Python: no torch, no Ray, no threads.

Words (docs/roles-and-schedules.md, "Asynchronous rollouts"):

- An agent's *policy version* is the number of updates its weights have had. Every completion records the
  version that drew it (`Completion.policy_version`); a frozen or idle agent's version does not move.
- An action's *staleness* when an update uses it is its agent's learner version minus the action's version.
  An update of agent X uses an action of X only if it is at most K_X versions behind, and only if every other
  agent acting in the same episode (its partners) is at most K_X versions behind that agent's learner too:
  an action scored against an outdated partner is as off-policy as an outdated action.
- The *lag* L is how many steps rollouts run ahead: the rollout of step r is drawn with every agent's weights
  as they stood after the updates of the steps before r - L (never before the step the pipeline started at).
  `rollout_lag` picks the largest L for which no agent updates more than K times in any L consecutive steps,
  so with the run's K every action, an agent's own and its partners', is at most K versions behind when used:
  K steps under `simultaneous`, 2K under `alternate`, nK under `round_robin` over n agents (period 1). An
  agent's own, tighter K_X lowers L until it holds at every update of X (a bound that no L > 0 can keep,
  such as K_X = 0 beside a partner that trains the step before, makes the rollouts synchronous): the pipeline
  waits rather than leave X with nothing fresh enough to train on.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from orchestrator.rollout import Episode
from orchestrator.schedule import Schedule
from protocols.config import RunConfig


def rollout_lag(training_agents: Callable[[int], list[str]], cycle: int, max_staleness: int,
                bounds: dict[str, int] | None = None) -> int:
    """The largest L such that no agent is among `training_agents(step)` more than `max_staleness` times in any
    L consecutive steps (the schedule repeats every `cycle` steps), and, with `bounds` (an agent's own K_X, at
    most K), no agent more than K_X times in the L steps before any step at which X trains: so X's own actions
    and its partners' (every agent of the run counts as one) are at most K_X versions behind when it uses them,
    and X is never left without an action to train on. 0 for K = 0; K when nobody ever trains."""
    if max_staleness == 0:
        return 0
    counts = [set(training_agents(s)) for s in range(cycle)]
    if not any(counts):
        return max_staleness
    agents = set().union(*counts)
    best = 0
    for lag in range(1, max_staleness * cycle + cycle + 1):
        worst = max(sum(agent in counts[(start + k) % cycle] for k in range(lag))
                    for start in range(cycle) for agent in agents)
        if worst > max_staleness:
            break
        best = lag
    tight = {x: k for x, k in (bounds or {}).items() if k < max_staleness and x in agents}
    while best > 0 and any(sum(y in counts[(step - k) % cycle] for k in range(1, best + 1)) > tight[x]
                           for step in range(cycle) for x in counts[step] & set(tight) for y in agents):
        best -= 1
    return best


def planned_lag(config: RunConfig, schedule: Schedule, bounds: dict[str, int]) -> tuple[int, str | None]:
    """The run's lag (`rollout_lag` with every agent's bound), and what to say when agents' own bounds hold the
    rollouts closer than `train.max_staleness` alone would: the agent whose bound holds them closest, both keys,
    and the fix (None when they do not)."""
    max_staleness = config.train.max_staleness
    lag_of = lambda own: rollout_lag(schedule.training_agents, schedule.cycle, max_staleness, own)  # noqa: E731
    lag, widest = lag_of(bounds), lag_of({})
    if lag >= widest:
        return lag, None
    own = {x: lag_of({x: k}) for x, k in bounds.items() if k < max_staleness}
    agent = min(own, key=lambda x: (own[x], bounds[x], x))
    where = "synchronous" if lag == 0 else f"{lag} step(s) ahead"
    kind = config.schedule.kind
    note = (f"agents.{agent}.rollout.max_staleness {bounds[agent]} keeps rollouts {where} (train.max_staleness "
            f"{max_staleness} alone plays them {widest} step(s) ahead under schedule {kind}, where {agent}'s own or its "
            f"partners' actions would be more than {bounds[agent]} version(s) behind at its updates, which would then be "
            f"skipped); raise agents.{agent}.rollout.max_staleness to {max_staleness} to play {widest} step(s) ahead"
            + (", or set train.max_staleness: 0 to say so" if lag == 0 else ""))
    return lag, note


def weights_step(rollout_step: int, lag: int, base: int) -> int:
    """The rollout of `rollout_step` is drawn with the weights every agent has after the updates of the steps
    before this one (`base`: the step the pipeline started at, whose weights are the oldest it has)."""
    return max(rollout_step - lag, base)


@dataclass
class Usable:
    """What an update may use of one rollout: each agent's experiences kept, and the figures per agent."""

    keep: dict[str, list[bool]] = field(default_factory=dict)
    """Per agent: one flag per action of its, in the order of `experiences_by_agent` (episode, turn, action)."""
    staleness: dict[str, list[int]] = field(default_factory=dict)
    """Per agent: versions behind of each of its actions."""
    partners: dict[str, int] = field(default_factory=dict)
    """Per agent: the most versions any partner in its episodes was behind."""

    def dropped(self, agent: str) -> int:
        return self.keep[agent].count(False)

    def metrics(self, agents: list[str]) -> dict[str, float]:
        """`staleness/NAME/mean|max|partners_max|dropped` (share of its actions dropped) and `dropped_actions`."""
        out = {}
        for agent in agents:
            if agent not in self.keep:
                continue
            behind = self.staleness[agent]
            out[f"staleness/{agent}/mean"] = statistics.fmean(behind) if behind else 0.0
            out[f"staleness/{agent}/max"] = max(behind, default=0)
            out[f"staleness/{agent}/partners_max"] = self.partners.get(agent, 0)
            out[f"staleness/{agent}/dropped"] = self.dropped(agent) / max(1, len(self.keep[agent]))
            out[f"staleness/{agent}/dropped_actions"] = self.dropped(agent)
        return out


def usable_actions(episodes: list[Episode], learners: dict[str, int], bounds: dict[str, int]) -> Usable:
    """Which actions of `episodes` each agent's update may use, given every agent's learner version (`learners`,
    before this step's updates) and each agent's bound K (`bounds`). Scripted actions (no version) are never stale."""
    usable = Usable()
    for episode in episodes:
        behind: dict[str, int] = {}  # agent -> most versions behind in this episode
        for turn in episode.turns:
            for action in turn.actions:
                version = action.completion.policy_version
                if version is not None and action.agent in learners:
                    behind[action.agent] = max(behind.get(action.agent, 0), learners[action.agent] - version)
        for turn in episode.turns:
            for action in turn.actions:
                agent = action.agent
                version = action.completion.policy_version
                own = learners[agent] - version if version is not None and agent in learners else 0
                partners = max((b for a, b in behind.items() if a != agent), default=0)
                bound = bounds.get(agent, 0)
                usable.keep.setdefault(agent, []).append(own <= bound and partners <= bound)
                usable.staleness.setdefault(agent, []).append(own)
                usable.partners[agent] = max(usable.partners.get(agent, 0), partners)
    return usable


# ------------------------------------------------------------------------------------------- timing
Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """The same time as disjoint, sorted intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def clipped(intervals: list[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo)]


def length(intervals: list[Interval]) -> float:
    return sum(b - a for a, b in union(intervals))


def overlap(first: list[Interval], second: list[Interval]) -> float:
    """Seconds during which both sets of intervals are running."""
    total, a, b = 0.0, union(first), union(second)
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def timing_metrics(calls: list[tuple[str, str, float, float]], window: Interval, agents: list[str]) -> dict[str, float]:
    """`time/overlap` (seconds some generate and some update ran at once) and `time/idle/NAME` (seconds of the
    step in which agent NAME ran no call) from `calls` (agent, generate | update, start, end) within `window`."""
    kinds: dict[str, list[Interval]] = defaultdict(list)
    busy: dict[str, list[Interval]] = defaultdict(list)
    for agent, kind, start, end in calls:
        kinds[kind].extend(clipped([(start, end)], window))
        busy[agent].extend(clipped([(start, end)], window))
    span = window[1] - window[0]
    out = {"time/overlap": overlap(kinds["generate"], kinds["update"])}
    for agent in agents:
        out[f"time/idle/{agent}"] = max(0.0, span - length(busy[agent]))
    return out
