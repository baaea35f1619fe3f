"""Hosts: the process that holds agents. A host holds one full-model agent, or several adapter agents on one
shared base model (`agents.NAME.host`, `hosts.NAME.resources`); `protocols.config.host_layout` says which.

`Host` is plain Python: `LocalTrainers` keeps its hosts in this process, and the Ray wrapper
(`agent_trainer.actor`) puts each in an actor of its own. Either way a call names the agent it is for; the
host runs it with that agent's adapter active and that agent's RNG state (`agent_trainer.adapters.selected`).
A host's agents answer one call at a time, so they never see each other's adapter or RNG state.
"""

from __future__ import annotations

from typing import Any, Callable

from agent_trainer.adapters import SharedBase
from agent_trainer.group import invoke, start_trainer
from agent_trainer.trainer import AgentTrainer
from protocols.config import RunConfig, host_layout


class Host:
    """The trainers of one host's agents; adapter agents among them share one base model."""

    def __init__(self, host: str, config: RunConfig, updates: dict[str, int], where: str = "this machine"):
        self.name = host
        self.agents = host_layout(config)[host]
        indices = {name: i for i, name in enumerate(config.agents)}  # seeds follow the declaration order
        base = SharedBase() if any(config.agents[a].adapter is not None for a in self.agents) else None
        self.trainers: dict[str, AgentTrainer] = {}
        for name in self.agents:
            self.trainers[name] = start_trainer(name, config, indices[name], updates[name], where=where, base=base)

    def call(self, agent: str, method: str | Callable, kwargs: dict[str, Any]):
        """Run `method` for `agent` (a trainer method's name, or a function taking the trainer first)."""
        return invoke(self.trainers[agent], method, kwargs)
