"""`environment` (the turn-based game), `roles` (which agent plays which role, how the seating rotates, how many
attempts a role makes at each prompt) and `schedule` (which agents update at each step, which never do)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from protocols.config.base import _Strict, unknown_agent

if TYPE_CHECKING:
    from protocols.config.run import RunConfig


class EnvironmentConfig(_Strict):
    name: str
    """Import path `package.module:Class`, or `file.py:Class` relative to the config file."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for the environment's constructor."""


class RolesConfig(_Strict):
    assignment: dict[str, str] | None = None
    """Role -> agent (one agent may hold several roles); with a `cycle`, its first entry (may be omitted)."""
    rotation: Literal["none", "per_episode", "per_turn"] = "none"
    """How often the seating advances along the cycle: never, every episode, or every turn."""
    cycle: list[dict[str, str]] | None = None
    """Explicit cycle of seatings (needs a rotation); None: the rotations of `assignment` (role i gets role
    i+1's agent)."""
    attempts: dict[str, int] = {}
    """Role -> k: that role answers each of its prompts k times in one turn (its k attempts share the prompt, go in
    one batched generate and are one advantage group), over the environment's own `attempts`, which must list the
    role. {}: the environment's k."""

    @model_validator(mode="after")
    def _seatings(self) -> RolesConfig:
        if self.cycle is not None and not self.cycle:
            raise ValueError("roles.cycle: give at least one seating, or leave it out")
        if self.assignment is None and not self.cycle:
            raise ValueError("roles.assignment: missing; seat every role (role: agent), or give roles.cycle")
        if self.cycle and self.rotation == "none":
            raise ValueError("roles.cycle: a cycle needs roles.rotation per_episode or per_turn (with rotation none "
                             "only its first seating would ever be used)")
        if self.cycle and self.assignment is not None and self.assignment != self.cycle[0]:
            raise ValueError(f"roles.assignment: {self.assignment} differs from roles.cycle's first seating "
                             f"{self.cycle[0]}; drop roles.assignment or make them equal")
        seated = self.seatings()[0]
        for role, k in self.attempts.items():
            problem = attempts_value_problem(f"roles.attempts.{role}", role, k, seated)
            if problem:
                raise ValueError(problem)
        return self

    def seatings(self) -> list[dict[str, str]]:
        """Every seating the run may use: the cycle, or the assignment's rotations (just it without rotation)."""
        if self.cycle:
            return [dict(a) for a in self.cycle]
        roles = list(self.assignment)
        if self.rotation == "none":
            return [dict(self.assignment)]
        agents = [self.assignment[r] for r in roles]
        return [{roles[i]: agents[(i + k) % len(roles)] for i in range(len(roles))} for k in range(len(roles))]


def attempts_value_problem(key: str, role: str, k: int, seated: dict[str, str]) -> str | None:
    """Why `key: k` cannot give `role` k attempts per prompt (k < 1, a role no seating seats), or None."""
    if k < 1:
        return f"{key}: {k}; a role answers each prompt k >= 1 times; give k >= 1, or remove it for the environment's k"
    if role not in seated:
        return (f"{key}: {k}, but no seating seats role {role!r} (seated: {', '.join(seated)}); fix the role's name "
                "or remove it")
    return None


def roles_problem(config: RunConfig) -> str | None:
    """Why the seatings do not fit the agents (an undefined agent, seatings of different roles, an agent no seating
    seats), naming the keys and the fix, or None."""
    seatings = config.roles.seatings()
    for i, seating in enumerate(seatings):
        key = f"roles.cycle.{i}" if config.roles.cycle else "roles.assignment"
        if problem := unknown_agent(key, list(seating.values()), config.agents):
            return problem
        if set(seating) != set(seatings[0]):
            return (f"roles.cycle.{i}: roles {sorted(seating)} differ from the first seating's {sorted(seatings[0])}; "
                    "every seating must seat the same roles")
    seated = {agent for seating in seatings for agent in seating.values()}
    for name in config.agents:
        if name not in seated:
            return (f"agents.{name}: holds no role in roles.assignment or roles.cycle, so it would load "
                    "and never act; seat it or remove it")
    return None


class ScheduleConfig(_Strict):
    kind: Literal["simultaneous", "alternate", "round_robin", "pattern"] = "simultaneous"
    """Which agents update at each step: all trainable ones; two agents taking turns (`alternate`); any
    number taking turns (`round_robin`); an explicit cycle of agent sets (`pattern`)."""
    period: int = Field(1, ge=1)
    """`alternate` / `round_robin`: steps each agent trains before the next one's turn."""
    order: list[str] | None = None
    """`alternate` (two agents) / `round_robin`: agents in turn order; None: the trainable agents as declared."""
    pattern: list[list[str]] | None = None
    """`pattern`: agent sets cycled one per step."""
    frozen: list[str] = []
    """Agents that never update (opponents, judges)."""


def schedule_problem(config: RunConfig) -> str | None:
    """Why the schedule does not fit the agents (an undefined agent, an empty pattern, an agent both frozen and
    scheduled, `alternate` between other than two), naming the keys and the fix, or None."""
    schedule = config.schedule
    named = [("schedule.frozen", schedule.frozen), ("schedule.order", schedule.order or []),
             *((f"schedule.pattern.{i}", group) for i, group in enumerate(schedule.pattern or []))]
    for key, names in named:
        if problem := unknown_agent(key, names, config.agents):
            return problem
    if schedule.kind == "pattern" and not schedule.pattern:
        return "schedule.pattern: kind 'pattern' needs a non-empty list of agent lists"
    frozen_ordered = set(schedule.order or []) & set(schedule.frozen)
    if frozen_ordered:
        return f"schedule.order: {sorted(frozen_ordered)} are also in schedule.frozen; remove them from one"
    for i, group in enumerate(schedule.pattern or []):
        frozen_listed = sorted(set(group) & set(schedule.frozen))
        if frozen_listed:
            return f"schedule.pattern.{i}: {frozen_listed} are also in schedule.frozen; remove them from one"
    if schedule.kind == "alternate":
        takers = schedule.order or [a for a in config.agents if a not in schedule.frozen]
        if len(takers) != 2:
            return (f"schedule.kind: alternate takes turns between two agents, got {len(takers)} "
                    f"({', '.join(takers) or 'none'}); use round_robin for any number, or set schedule.order")
    return None
