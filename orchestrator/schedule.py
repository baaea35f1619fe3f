"""Which agents train at step k, and which agent plays each role on a given episode and turn.

Both are pure functions of the step / episode / turn index, so a resumed run continues exactly.
"""

from __future__ import annotations

from protocols.config import RolesConfig, RunConfig, ScheduleConfig


class Schedule:
    """`simultaneous`: every trainable agent, every step. `alternate` / `round_robin`: the agents of
    `order` take turns, `period` steps each. `pattern`: the listed agent sets, cycled one per step.
    Agents in `frozen` never train."""

    def __init__(self, config: ScheduleConfig, agents: list[str]):
        self.config = config
        self.trainable = [a for a in agents if a not in config.frozen]
        self.order = config.order or self.trainable

    def training_agents(self, step: int) -> list[str]:
        kind = self.config.kind
        if kind == "simultaneous":
            return list(self.trainable)
        if kind in ("alternate", "round_robin"):
            if not self.order:
                return []
            return [self.order[(step // self.config.period) % len(self.order)]]
        pattern = self.config.pattern
        return [a for a in pattern[step % len(pattern)] if a in self.trainable]

    @property
    def cycle(self) -> int:
        """Steps after which `training_agents` repeats."""
        kind = self.config.kind
        if kind in ("alternate", "round_robin"):
            return max(1, len(self.order)) * self.config.period
        return len(self.config.pattern) if kind == "pattern" else 1

    def updates(self, agent: str, steps: int) -> int:
        """Updates `agent` makes in the first `steps` steps."""
        return sum(agent in self.training_agents(k) for k in range(steps))


class RoleAssignment:
    """Role -> agent per (episode, turn): the cycle is `roles.cycle`, or the rotations of
    `roles.assignment` (rotation k gives role i the agent of role i + k); `rotation` picks the index."""

    def __init__(self, config: RolesConfig):
        self.config = config
        self.cycle = config.seatings()

    def __call__(self, episode: int, turn: int) -> dict[str, str]:
        rotation = self.config.rotation
        index = episode if rotation == "per_episode" else turn if rotation == "per_turn" else 0
        return self.cycle[index % len(self.cycle)]


def seating_problem(roles: RolesConfig, possible_agents: list[str]) -> str | None:
    """Why the seatings do not fit the environment's roles (a misspelt role, a role with no seat), or None."""
    key = "roles.cycle" if roles.cycle else "roles.assignment"
    seated = set(roles.seatings()[0])
    unknown = sorted(seated - set(possible_agents))
    if unknown:
        return (f"{key}: role {unknown[0]!r} is not one of the environment's roles ({', '.join(possible_agents)}); "
                "fix the name")
    unseated = [r for r in possible_agents if r not in seated]
    if unseated:
        return f"{key}: the environment's role {unseated[0]!r} has no seat; seat every role (role: agent)"
    return None


def attempts_problem(config: RunConfig, listed: dict[str, int]) -> str | None:
    """Why `roles.attempts` or `eval.attempts` do not fit the environment's `attempts` (`listed`: a role it does not
    list answers once, and its step takes one answer), or why the run's credit cannot score attempts; or None."""
    evaluated = config.eval.attempts if config.eval else {}
    for key, wanted in (("roles.attempts", config.roles.attempts), ("eval.attempts", evaluated)):
        for role, k in wanted.items():
            if role not in listed:
                return (f"{key}.{role}: {k}, but the environment's attempts do not list role {role!r} (they list "
                        f"{', '.join(listed) or 'none'}), so its step takes one answer from {role!r}; remove it, or "
                        "list the role in the environment's attempts")
    tries = {**listed, **config.roles.attempts}
    several = next((role for role, k in tries.items() if k > 1), None)
    if config.algorithm.baseline == "critic" and several is not None:
        where = "roles.attempts" if several in config.roles.attempts else "the environment's attempts"
        return (f"algorithm.baseline: critic values one answer per role and turn, but role {several!r} answers each "
                f"prompt {tries[several]} times ({where}); set algorithm.baseline: group or ema, or "
                f"roles.attempts.{several}: 1")
    return None
