"""Hosts: the process that holds agents. A host holds one full-model agent (`AgentTrainer`), or several
adapter agents (`adapters.AdapterTrainer`) on one shared base model (`agents.NAME.host`,
`hosts.NAME.resources`); `protocols.config.host_layout` says which.

`Host` is plain Python: `LocalTrainers` keeps its hosts in this process, and the Ray wrapper
(`agent_trainer.actor`) puts each in an actor of its own. Either way a call names the agent it is for and an
`Agent` method; the agent runs it inside its trainer's `selected` context (an adapter agent's adapter and
RNG state). A host's agents answer one call at a time, so they never see each other's adapter or RNG state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from agent_trainer import storage
from agent_trainer.adapters import AdapterTrainer, SharedBase
from agent_trainer.agent import Agent
from agent_trainer.dispatch import dispatch_of
from agent_trainer.handle import TrainerStartError
from agent_trainer.trainer import AgentTrainer
from protocols.config import RunConfig, host_layout
from protocols.errors import describe


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
        self.served = {name: Agent(trainer) for name, trainer in self.trainers.items()}

    def call(self, agent: str, method: Callable, *args: Any) -> Any:
        """Run `method` (an `Agent` method, which declares its dispatch) for `agent`."""
        dispatch_of(method)
        return method(self.served[agent], *args)


def missing_model_path(name: str, config: RunConfig, where: str) -> str | None:
    """Why agent `name` cannot load here: its model or tokenizer is a local path (absolute, as the config
    resolves it; a hub id or a built-in is not) that does not exist on this node, or None."""
    agent = config.agents[name]
    for key in ("model", "tokenizer"):
        value = getattr(agent, key)
        if value and value.startswith("/") and not Path(value).exists():
            return (f"agent {name!r}: agents.{name}.{key} {value!r} does not exist on {where}, which hosts this agent; "
                    "copy it to that path on every node that may host the agent, or give a hub id or a built-in")
    return None


def start_trainer(name: str, config: RunConfig, index: int, total_updates: int,
                  where: str = "this machine", base: SharedBase | None = None) -> AgentTrainer:
    """The trainer of agent `name`, of its host kind (an adapter agent on `base`, the host's shared base
    model; else a full-model agent); any failure becomes a one-line TrainerStartError. `where` names the
    node in messages."""
    storage.set_deadline(config.train.storage_timeout_s)  # every call to the store from this trainer's process
    problem = missing_model_path(name, config, where)
    if problem:
        raise TrainerStartError(problem)
    agent = config.agents[name]
    kwargs = dict(seed=config.train.seed + index, total_updates=total_updates,
                  trainable=name not in config.schedule.frozen)
    try:
        if agent.adapter is not None:
            trainer = AdapterTrainer(name, agent, config.algorithm, base=base, **kwargs)
        else:
            trainer = AgentTrainer(name, agent, config.algorithm, **kwargs)
    except Exception as exc:
        raise TrainerStartError(f"agent {name!r} could not start: {describe(exc)}") from exc
    trainer.where = where
    return trainer
