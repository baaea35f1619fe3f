"""Credit from a critic (`algorithm.baseline: critic`): each action's advantage is GAE over its (agent, role)'s
turns against a learned value, normalised per agent; each critic learns the lambda-returns of its states.
Plain Python on the coordinator: the critics (`agent_trainer.critic`) compute the values.

The turn structure (docs/rl-maths.md says where it follows or departs from PPO and MAAC):

- A chain is one (agent, role) of one episode: the turns at which that agent acted in that role. Its
  rewards are the role's (the shared reward, or the role's own in a per-role game), summed and discounted
  per turn between its decisions (`advantages.decision_rewards`).
- A state is text: what the critic may see before the action. A per-agent critic (`critic-AGENT`) sees
  that agent's own prompts and answers of the episode so far, then the role's prompt now; the central
  critic (`critic`) sees every agent's prompts and answers so far, then every prompt of this turn, the
  role's own last. Both end with the role being valued (its prompt), so a chain's states begin each other.
- After the chain's last turn: value 0 when the episode terminated; when it was truncated (`max_turns`, or
  the environment's `truncated`), the critic's value of the state after the last turn (with the prompts the
  last step returned, if any) bootstraps it.
- Actions of an agent without a critic (a frozen agent under `kind: per_agent`) get advantage 0; they are
  never trained on.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

from orchestrator.advantages import decision_rewards, gae, normalised_per_agent
from orchestrator.rollout import Action, Episode
from protocols.config import RunConfig
from protocols.messages import Experience, Prompt, ValueTarget
from protocols.plan import RunPlan

ValuesFn = Callable[[dict[str, list[str]]], dict[str, list[float]]]
"""Critic name -> states, to critic name -> their values (`Coordinator.values`)."""


def prompt_text(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def critic_state(episode: Episode, turn: int, role: str, agent: str, central: bool) -> str:
    """The input of `agent`'s critic (every agent's turns with `central`) for `role` about to act at `turn`
    (0-based); `turn == len(episode.turns)` is the state after the last turn. It ends with the role's prompt
    now (the central critic's other prompts of the turn come before it), so each state of a turn-taking
    chain begins the next one and the critic reads them in one forward (`CriticTrainer._batches`); a role
    with no prompt now (after the last turn) ends with `value of [role]`."""
    lines = []
    for past in episode.turns[:turn]:
        for action in past.actions:
            if central or action.agent == agent:
                lines += [f"[{action.role}] {prompt_text(action.prompt)}",
                          f"[{action.role}] > {action.completion.text}"]
    if turn < len(episode.turns):
        now = {a.role: a.prompt for a in episode.turns[turn].actions}
    else:
        now = episode.next_prompts
    for r, prompt in now.items():
        if central and r != role:
            lines.append(f"[{r}] {prompt_text(prompt)}")
    lines.append(f"[{role}] {prompt_text(now[role])}" if role in now else f"value of [{role}]")
    return "\n".join(lines)


class CriticCredit:
    """Advantages and value targets of a step's episodes, from the run's critics."""

    def __init__(self, config: RunConfig, plan: RunPlan):
        self.algorithm, self.critic = config.algorithm, plan.critic
        self.critics = plan.critic_members
        self.critic_of = {agent: name for name, agents in self.critics.items() for agent in agents}

    def score(self, episodes: list[Episode], values_of: ValuesFn
              ) -> tuple[dict[str, list[Experience]], dict[str, list[ValueTarget]]]:
        """Every action of a critic's agent as an Experience with its advantage, per agent (each action's
        `advantage` set too, for its transcript), and each critic's value targets."""
        central = self.critic.kind == "central"
        states: dict[str, list[str]] = defaultdict(list)
        chains = []  # (episode, role, critic, [(turn, action, state index)], bootstrap state index or None)
        for episode in episodes:
            seats: dict[tuple[str, str], list[tuple[int, Action, int]]] = {}
            for t, turn in enumerate(episode.turns):
                for action in turn.actions:
                    critic = self.critic_of.get(action.agent)
                    if critic is None:
                        action.advantage = 0.0
                        continue
                    states[critic].append(critic_state(episode, t, action.role, action.agent, central))
                    seats.setdefault((action.agent, action.role), []).append((t, action, len(states[critic]) - 1))
            for (agent, role), decisions in seats.items():
                critic, bootstrap = self.critic_of[agent], None
                if episode.truncated and not episode.terminated:
                    states[critic].append(critic_state(episode, len(episode.turns), role, agent, central))
                    bootstrap = len(states[critic]) - 1
                chains.append((episode, role, critic, decisions, bootstrap))
        values = values_of(dict(states))
        actions, advantages, returns, targets = [], [], [], defaultdict(list)
        for episode, role, critic, decisions, bootstrap in chains:
            mine = values[critic]
            rewards, gaps = decision_rewards(episode.role_rewards(role), [t for t, _, _ in decisions],
                                             self.algorithm.discount)
            chain_values = [mine[i] for _, _, i in decisions]
            last = mine[bootstrap] if bootstrap is not None else 0.0
            discount, lam = self.algorithm.discount, self.critic.gae_lambda
            adv, lambda_returns = gae(rewards, chain_values, gaps, discount, lam, last)
            plain, _ = gae(rewards, [0.0] * len(rewards), gaps, discount, 1.0, 0.0)  # the discounted returns
            for (_, action, i), a, v, g, r in zip(decisions, adv, chain_values, lambda_returns, plain):
                actions.append(action)
                advantages.append(a)
                returns.append(r)
                targets[critic].append(ValueTarget(state=states[critic][i], old_value=v, target=g))
        out: dict[str, list[Experience]] = {}
        for action, advantage in zip(actions, normalised_per_agent(advantages, [a.agent for a in actions], returns)):
            action.advantage = advantage
            out.setdefault(action.agent, []).append(Experience.from_completion(action.completion, advantage))
        return out, dict(targets)
