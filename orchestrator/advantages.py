"""Returns and advantages per (episode, turn, role), turned into each agent's experiences."""

from __future__ import annotations

import torch

from agent_trainer.losses import discounted_returns, ema_update, group_relative_advantages
from orchestrator.rollout import Episode
from protocols.config import AlgorithmConfig
from protocols.messages import Experience


def experiences_by_agent(episodes: list[Episode], algorithm: AlgorithmConfig,
                         baselines: dict[str, float]) -> dict[str, list[Experience]]:
    """Every action as an Experience with its advantage, grouped by agent. `baselines` (EMA per role)
    is updated in place when `algorithm.baseline == "ema"`."""
    actions, returns, keys, roles = [], [], [], []
    for episode in episodes:
        per_role = {r: discounted_returns(episode.role_rewards(r), algorithm.discount) for r in episode.env.possible_agents}
        for t, turn in enumerate(episode.turns):
            for action in turn.actions:
                actions.append(action)
                returns.append(per_role[action.role][t])
                roles.append(action.role)
                turn_key = t if algorithm.group_by == "agent_turn" else -1
                keys.append((episode.sample_index, action.agent, turn_key))
    if not actions:
        return {}
    if algorithm.baseline == "group":
        ids = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        advantages = group_relative_advantages(torch.tensor(returns, dtype=torch.float64),
                                               torch.tensor([ids[k] for k in keys]),
                                               scale=algorithm.scale_rewards).tolist()
    else:
        advantages = [0.0] * len(actions)
        for role in dict.fromkeys(roles):
            idx = [i for i, r in enumerate(roles) if r == role]
            adv, baselines[role] = ema_update(baselines.get(role), [returns[i] for i in idx], algorithm.ema_decay)
            for i, a in zip(idx, adv):
                advantages[i] = a
    out: dict[str, list[Experience]] = {}
    for action, advantage in zip(actions, advantages):
        out.setdefault(action.agent, []).append(Experience.from_completion(action.completion, advantage))
    return out
