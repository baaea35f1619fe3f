"""The coordinator's own state: what the next step depends on beside the trainers' weights, saved with every
checkpoint (`orchestrator.checkpoints`) and given back by restore."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from orchestrator.advantages import Baselines
from orchestrator.data import DataPosition


@dataclass
class CoordinatorState:
    """Everything of the coordinator's that the next step depends on (the trainers hold the rest)."""

    step: int = 0
    """Steps completed."""
    episodes: int = 0
    """Episodes played: the next episode's index, which per-episode role rotation follows."""
    data: DataPosition = field(default_factory=DataPosition)
    baselines: Baselines = field(default_factory=dict)
    """EMA return baseline per agent, role and turn (algorithm.baseline == "ema")."""
    loop_state: dict[str, Any] = field(default_factory=dict)
    """A custom loop's own state (JSON values), saved with each checkpoint and given back by restore."""
    versions: dict[str, int] = field(default_factory=dict)
    """Each agent's policy version (its updates so far); absent: 0."""
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    """Asynchronous rollouts (train.max_staleness > 0): the episodes of the steps after `step` already played with
    weights older than the checkpoint's (`pipeline.Played.record`); `data` and `episodes` stand after them."""
