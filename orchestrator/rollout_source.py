"""What the rollouts of a run (`orchestrator.pipeline`) draw on: the coordinator seen through the few members
they use, so that the pipeline depends on these and not on the coordinator."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol

from agent_trainer.handle import TrainerPool
from orchestrator.coordinator_state import CoordinatorState
from orchestrator.rollout import Episode
from orchestrator.schedule import RoleAssignment
from protocols.config import RunConfig
from protocols.env import Environment
from protocols.plan import RunPlan


class RolloutSource(Protocol):
    """`Coordinator` is one. `state` is read as it is at each use: the rollouts move its data position and episode
    counter, read the agents' policy versions, and hand over the rollouts played ahead into it."""

    config: RunConfig
    plan: RunPlan
    samples: Any
    """The task dataset (a `datasets.Dataset`, or a list of samples)."""
    make_env: Callable[[], Environment]
    assignment: RoleAssignment

    @property
    def state(self) -> CoordinatorState: ...

    @property
    def pool(self) -> TrainerPool:
        """Every agent's handle: the asynchronous rollouts generate through it with the policy version planned."""

    def play(self, samples: list[dict[str, Any]]) -> list[Episode]:
        """`num_generations` episodes per sample at the current weights (the synchronous rollouts)."""

    def check_agents(self, agents: Iterable[str], action: str) -> None:
        """Refuse (`ConfigError`) an agent that is not defined, or that is frozen when `action` is "train"."""

    def warn_once(self, agent: str, kind: str, message: str) -> None:
        """Say `message` on stderr the first time (`agent`, `kind`) comes up."""
