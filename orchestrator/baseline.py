"""Baseline: the interface of a baseline strategy, how one agent's returns become advantages. The strategies:
`orchestrator/baselines.py` (`group`, `ema`, and the registry), `orchestrator/baseline_NAME.py` (one each)."""

from __future__ import annotations

import abc
from collections.abc import Hashable
from typing import ClassVar

from orchestrator.advantages import Baselines
from protocols.config import AlgorithmConfig

Seat = tuple[str, str, str]
"""(agent, role, turn counted from 1 as a string)."""


class Baseline(abc.ABC):
    """One agent's advantages from its returns. `kept` holds what a strategy carries from batch to batch (saved in
    checkpoints with the coordinator's state; only `ema` keeps anything)."""

    name: ClassVar[str]

    @abc.abstractmethod
    def advantages(self, agent: str, returns: list[float], groups: list[Hashable], seats: list[Seat],
                   algorithm: AlgorithmConfig, kept: Baselines) -> list[float]:
        """The advantage of each of `agent`'s actions, given each one's return, group and seat, in that order;
        `algorithm` is the agent's own settings (`AlgorithmConfig.for_agent`)."""
