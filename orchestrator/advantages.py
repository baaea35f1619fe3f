"""Returns and advantages per (episode, turn, role), which `orchestrator.baselines.experiences_by_agent` turns
into each agent's experiences: plain Python, cheap, on the coordinator (which imports no torch).

Group baselines (GRPO) compare like with like: by default an action is compared only with the actions
of the same agent, in the same role, at the same turn, in the episodes played from the same sample
(AT-GRPO's grouping). An agent that plays two seats, or two turns whose returns differ by design
(discount < 1, rewards paid on one turn), is otherwise scored against itself. `algorithm.group_by`
names the wider pools. The k attempts of a role at one prompt (`roles.attempts`, k > 1) are always a group
of their own (TRL's group: the completions of one prompt), whatever `group_by` says: attempts at different
prompts (a solver trying two proposed problems) are not like with like; with k = 1 the one attempt groups
as an answer does. `algorithm.agents` gives an agent
its own baseline, `group_by` and `scale_rewards`. Which baseline scores an agent's actions is a strategy
(`orchestrator.baselines`); the functions here are their maths.

- `group_relative_advantages` follows GRPO (Shao et al., 2024, "DeepSeekMath"): reward minus the
  mean of its group, divided by the group's std when `scale` (GRPO) or not (Dr. GRPO, Liu et al.,
  2025). Departures: groups are given by arbitrary hashable ids, so groups may differ in size
  (episodes that ended early, per-(agent, role, turn) groups); the std is the population std (ddof=0),
  so a group of one gets advantage 0 instead of NaN; `eps` guards a zero std.
- `ema_advantages` is the moving-average baseline of SPIRAL's role-conditioned advantage estimation
  (Liu et al., 2025), starting at 0 as SPIRAL's does. Departures: it is kept per (agent, role, turn),
  not per (agent, role), for the reason groups are: turns whose returns differ by design (discount < 1,
  a reward paid on the last turn) would otherwise share one baseline and score each other. SPIRAL
  folds each game's return into b before scoring the next, so there a game's advantage depends on the
  games before it in the batch; here a batch's n returns are all scored against b from before the
  batch, then b <- decay**n * b + (1 - decay**n) * mean(returns): the weight n sequential updates leave
  on the old b, the batch's returns weighted equally, so episode order never matters.
- `discounted_returns`: G_t = r_t + discount * G_{t+1}, per role over an episode's turns. An attempt's
  return is its own reward at its turn plus the discounted later returns, in which an attempts role's
  reward at a turn is the mean over its attempts.
- `gae` is generalised advantage estimation (Schulman et al., 2016) over one (agent, role)'s decisions of an
  episode, for `algorithm.baseline: critic` (`orchestrator.credit`). Departure: decisions may be turns
  apart (roles that take turns), so decision k's reward is the discounted sum of the turn rewards up to the
  next decision (`decision_rewards`) and its next value is discounted by discount**gap, gap the turns
  between them (a semi-MDP); lambda weighs decisions, not turns. With every gap 1 it is PPO's GAE.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence

from orchestrator.rollout import Episode
from protocols.config import AlgorithmConfig

GROUP_KEYS = {
    "agent_role_turn": lambda agent, role, turn: (agent, role, turn),
    "agent_role": lambda agent, role, turn: (agent, role),
    "agent_turn": lambda agent, role, turn: (agent, turn),
    "agent": lambda agent, role, turn: (agent,),
}

Baselines = dict[str, dict[str, dict[str, float]]]
"""EMA baseline per agent, then role, then turn (counted from 1, as a string: it is saved as JSON)."""


def scored_actions(episodes: list[Episode], algorithm: AlgorithmConfig) -> tuple[list, list[float], list, list]:
    """Every action of `episodes`, its return, its group (sample, then its agent's `group_by` key; an attempt's, k > 1:
    its episode, role and turn, the k attempts at that prompt) and its seat (agent, role, turn counted from 1)."""
    actions, returns, keys, seats = [], [], [], []
    group_keys = {}
    for episode in episodes:
        per_role = {r: discounted_returns(episode.role_rewards(r), algorithm.discount) for r in episode.env.possible_agents}
        for t, turn in enumerate(episode.turns):
            tries = Counter(a.role for a in turn.actions if a.attempt is not None)  # role -> k at this prompt
            for action in turn.actions:
                if action.agent not in group_keys:
                    group_keys[action.agent] = GROUP_KEYS[algorithm.for_agent(action.agent).group_by]
                actions.append(action)
                if tries[action.role] < 2:  # one answer (k = 1 too): grouped by `group_by`
                    returns.append(per_role[action.role][t])
                    keys.append((episode.sample_index, *group_keys[action.agent](action.agent, action.role, t)))
                else:  # its own reward, then the role's later returns; grouped with the other attempts at its prompt
                    later = per_role[action.role][t + 1] if t + 1 < len(episode.turns) else 0.0
                    returns.append(turn.reward_of(action.role, action.attempt) + algorithm.discount * later)
                    keys.append((episode.sample_index, "attempts", episode.index, action.role, t))
                seats.append((action.agent, action.role, str(t + 1)))
    return actions, returns, keys, seats


def zero_variance_shares(episodes: list[Episode], algorithm: AlgorithmConfig) -> dict[str, float]:
    """Per agent: the share of its groups whose returns are all equal (every episode of a sample won, or every one
    lost). Under group baselines they carry no gradient: a rising share while the reward stays flat is a stall."""
    actions, returns, keys, _ = scored_actions(episodes, algorithm)
    groups: dict[Hashable, tuple[str, set[float]]] = {}
    for action, value, key in zip(actions, returns, keys):
        groups.setdefault(key, (action.agent, set()))[1].add(value)
    flat, total = defaultdict(int), defaultdict(int)
    for agent, values in groups.values():
        total[agent] += 1
        flat[agent] += len(values) == 1
    return {agent: flat[agent] / total[agent] for agent in sorted(total)}


def saved_baselines(saved: dict, max_turns: int) -> Baselines:
    """EMA baselines as a checkpoint holds them. One written while they were kept per (agent, role) gives
    a role's value to each of its turns: the best estimate it has, refined from there."""
    return {agent: {role: value if isinstance(value, dict) else {str(t): float(value) for t in range(1, max_turns + 1)}
                    for role, value in roles.items()} for agent, roles in saved.items()}


def group_relative_advantages(rewards: Sequence[float], group_ids: Sequence[Hashable], scale: bool = True,
                              eps: float = 1e-4) -> list[float]:
    """Per reward: reward minus its group's mean, divided by the group's population std when `scale`."""
    members: dict[Hashable, list[float]] = defaultdict(list)
    for reward, group in zip(rewards, group_ids, strict=True):
        members[group].append(float(reward))
    mean = {g: sum(rs) / len(rs) for g, rs in members.items()}
    centred = [float(r) - mean[g] for r, g in zip(rewards, group_ids)]
    if not scale:
        return centred
    std = {g: math.sqrt(sum((r - mean[g]) ** 2 for r in rs) / len(rs)) for g, rs in members.items()}
    return [c / (std[g] + eps) for c, g in zip(centred, group_ids)]


def ema_advantages(baseline: float, returns: list[float], decay: float) -> tuple[list[float], float]:
    """Advantages of a batch of `returns` against `baseline`, and the baseline with the batch folded in."""
    if not returns:
        return [], baseline
    kept = decay ** len(returns)
    return [r - baseline for r in returns], kept * baseline + (1.0 - kept) * sum(returns) / len(returns)


def discounted_returns(rewards: list[float], discount: float) -> list[float]:
    """Return per turn: G_t = r_t + discount * G_{t+1}."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + discount * running
        out[t] = running
    return out


def decision_rewards(rewards: list[float], turns: list[int], discount: float) -> tuple[list[float], list[int]]:
    """For decisions taken at `turns` (0-based, increasing) of an episode with per-turn `rewards`: each
    decision's reward (the rewards from its turn up to the next decision's, discounted per turn) and its
    gap (turns to the next decision, or to the episode's end)."""
    ends = [*turns[1:], len(rewards)]
    out = [sum(discount ** (j - t) * rewards[j] for j in range(t, end)) for t, end in zip(turns, ends)]
    return out, [end - t for t, end in zip(turns, ends)]


def gae(rewards: list[float], values: list[float], gaps: list[int], discount: float, lam: float,
        last_value: float) -> tuple[list[float], list[float]]:
    """GAE advantages and lambda-returns (advantage + value) of one chain of decisions. `values[k]`: the critic's
    value before decision k; `last_value`: its value after the chain's last turn, 0 when the episode
    terminated (a truncated one is bootstrapped). A_k = delta_k + (discount**gap_k * lam) * A_{k+1} with
    delta_k = r_k + discount**gap_k * V_{k+1} - V_k."""
    advantages, running, next_value = [0.0] * len(rewards), 0.0, last_value
    for k in reversed(range(len(rewards))):
        step = discount ** gaps[k]
        delta = rewards[k] + step * next_value - values[k]
        running = delta + step * lam * running
        advantages[k], next_value = running, values[k]
    return advantages, [a + v for a, v in zip(advantages, values)]


def normalised_per_agent(advantages: Sequence[float], agents: Sequence[str], returns: Sequence[float] | None = None,
                         eps: float = 1e-4, rtol: float = 1e-6) -> list[float]:
    """Each advantage minus its agent's mean over the batch, divided by that agent's population std (+ eps).
    With `returns` (each action's discounted return, no value in it): an agent whose returns all lie within
    `rtol` times their largest magnitude of each other (all equal, whatever the reward's scale) gets advantage 0.
    Its batch then carried no reward signal, and what spread its advantages have is the critic's own error, in
    the reward's units: divided by its std it would be a full-size random update, and left as it is, one that
    grows with the reward's scale (rewards of 3 gave a larger step than a batch with signal). A flat group gets
    0 under group baselines for the same reason."""
    members: dict[str, list[float]] = defaultdict(list)
    for a, agent in zip(advantages, agents, strict=True):
        members[agent].append(a)
    mean = {g: sum(v) / len(v) for g, v in members.items()}
    std = {g: math.sqrt(sum((x - mean[g]) ** 2 for x in v) / len(v)) for g, v in members.items()}
    scale = {g: std[g] + eps for g in members}
    flat: set[str] = set()
    if returns is not None:
        spread: dict[str, list[float]] = defaultdict(list)
        for r, agent in zip(returns, agents, strict=True):
            spread[agent].append(r)
        flat = {g for g, rs in spread.items() if max(rs) - min(rs) <= rtol * max(abs(r) for r in rs)}
    return [0.0 if g in flat else (a - mean[g]) / scale[g] for a, g in zip(advantages, agents)]
