"""The turn-based environment interface.

Names follow PettingZoo: `possible_agents` are the environment's roles (marsi keeps "agent" for a
trainable policy), `reset` and `step` drive an episode, `terminated` / `truncated` end it, `infos`
carry per-role details. One turn: every acting role gets a prompt and answers with text.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from protocols.messages import Prompt

Reward = float | dict[str, float]
"""A shared team reward, or one reward per role (zero-sum games)."""


@dataclass
class StepResult:
    prompts: dict[str, Prompt]
    """Prompts of the roles that act next turn; empty when the episode ended."""
    reward: Reward
    """This turn's reward: one float shared by all roles, or a float per role."""
    terminated: bool = False
    """The episode reached a natural end."""
    truncated: bool = False
    """The episode was cut off (turn limit)."""
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-role details; an invalid action is reported as infos[role] = {"invalid": True, "reason": ...}."""


class Environment(abc.ABC):
    """A turn-based multi-role text environment. One instance plays one episode at a time."""

    possible_agents: list[str]
    """Every role that can act in this environment."""
    max_turns: int
    """Upper bound on turns per episode; the environment truncates at it."""

    @abc.abstractmethod
    def reset(self, sample: dict[str, Any], seed: int | None = None) -> dict[str, Prompt]:
        """Start an episode from a data sample; return the first turn's prompt per acting role."""

    @abc.abstractmethod
    def step(self, actions: dict[str, str]) -> StepResult:
        """Apply one text action per acting role; never raise on bad model text (report it in infos)."""

    def episode_info(self) -> dict[str, Any]:
        """Scalar metrics of the finished episode (accuracy, win, legal-move rate); logged per episode."""
        return {}
