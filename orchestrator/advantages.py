"""Returns and advantages per (episode, turn, role), turned into each agent's experiences.

Group baselines (GRPO) compare like with like: by default an action is compared only with the actions
of the same agent, in the same role, at the same turn, in the episodes played from the same sample
(AT-GRPO's grouping). An agent that plays two seats, or two turns whose returns differ by design
(discount < 1, rewards paid on one turn), is otherwise scored against itself. `algorithm.group_by`
names the wider pools.

EMA baselines (SPIRAL's role-conditioned advantage estimation) are kept per (agent, role), start at 0
as SPIRAL's do, and treat a batch as a set: every return of the batch is measured against the baseline
from before the batch, and the batch then moves the baseline by as much as folding its returns in one
by one would, with each return weighted equally. SPIRAL folds games in one at a time, so there a
game's advantage depends on the games before it in the batch; here it does not.
"""

from __future__ import annotations

import torch

from agent_trainer.losses import discounted_returns, ema_advantages, group_relative_advantages
from orchestrator.rollout import Episode
from protocols.config import AlgorithmConfig
from protocols.messages import Experience

GROUP_KEYS = {
    "agent_role_turn": lambda agent, role, turn: (agent, role, turn),
    "agent_role": lambda agent, role, turn: (agent, role),
    "agent_turn": lambda agent, role, turn: (agent, turn),
    "agent": lambda agent, role, turn: (agent,),
}

Baselines = dict[str, dict[str, float]]
"""EMA baseline per agent, then per role."""


def experiences_by_agent(episodes: list[Episode], algorithm: AlgorithmConfig,
                         baselines: Baselines) -> dict[str, list[Experience]]:
    """Every action as an Experience with its advantage, grouped by agent. `baselines` is updated in
    place when `algorithm.baseline == "ema"`."""
    actions, returns, keys = [], [], []
    group_key = GROUP_KEYS[algorithm.group_by]
    for episode in episodes:
        per_role = {r: discounted_returns(episode.role_rewards(r), algorithm.discount) for r in episode.env.possible_agents}
        for t, turn in enumerate(episode.turns):
            for action in turn.actions:
                actions.append(action)
                returns.append(per_role[action.role][t])
                keys.append((episode.sample_index, *group_key(action.agent, action.role, t)))
    if not actions:
        return {}
    if algorithm.baseline == "group":
        ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        advantages = group_relative_advantages(torch.tensor(returns, dtype=torch.float64),
                                               torch.tensor([ids[k] for k in keys]),
                                               scale=algorithm.scale_rewards).tolist()
    else:
        advantages = [0.0] * len(actions)
        seats = [(a.agent, a.role) for a in actions]
        for agent, role in dict.fromkeys(seats):
            idx = [i for i, seat in enumerate(seats) if seat == (agent, role)]
            mine = baselines.setdefault(agent, {})
            adv, mine[role] = ema_advantages(mine.get(role, 0.0), [returns[i] for i in idx], algorithm.ema_decay)
            for i, a in zip(idx, adv):
                advantages[i] = a
    out: dict[str, list[Experience]] = {}
    for action, advantage in zip(actions, advantages):
        out.setdefault(action.agent, []).append(Experience.from_completion(action.completion, advantage))
    return out
