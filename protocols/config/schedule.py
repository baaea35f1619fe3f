"""`schedule`: which agents update at each step, and which never do."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from protocols.config.base import _Strict, unknown_agent

if TYPE_CHECKING:
    from protocols.config.run import RunConfig


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

    @model_validator(mode="after")
    def _checks(self) -> ScheduleConfig:
        if self.kind == "pattern" and not self.pattern:
            raise ValueError("schedule.pattern: kind 'pattern' needs a non-empty list of agent lists")
        frozen_ordered = set(self.order or []) & set(self.frozen)
        if frozen_ordered:
            raise ValueError(f"schedule.order: {sorted(frozen_ordered)} are also in schedule.frozen; remove them from one")
        for i, group in enumerate(self.pattern or []):
            frozen_listed = sorted(set(group) & set(self.frozen))
            if frozen_listed:
                raise ValueError(f"schedule.pattern.{i}: {frozen_listed} are also in schedule.frozen; remove them from one")
        return self


def schedule_problem(config: RunConfig) -> str | None:
    """Why the schedule does not fit the agents (an undefined agent, `alternate` between other than two), naming
    the keys and the fix, or None."""
    schedule = config.schedule
    named = [("schedule.frozen", schedule.frozen), ("schedule.order", schedule.order or []),
             *((f"schedule.pattern.{i}", group) for i, group in enumerate(schedule.pattern or []))]
    for key, names in named:
        if problem := unknown_agent(key, names, config.agents):
            return problem
    if schedule.kind == "alternate":
        takers = schedule.order or [a for a in config.agents if a not in schedule.frozen]
        if len(takers) != 2:
            return (f"schedule.kind: alternate takes turns between two agents, got {len(takers)} "
                    f"({', '.join(takers) or 'none'}); use round_robin for any number, or set schedule.order")
    return None
