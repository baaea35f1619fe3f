"""Hosts: the process that holds agents. A host holds one full-model agent (`AgentTrainer`), or several
adapter agents (`adapters.AdapterTrainer`) on one shared base model (`agents.NAME.host`,
`hosts.NAME.resources`); the run's plan (`protocols.plan.RunPlan.host_layout`) says which. A critic
(`agent_trainer.critic`) lives in a host too, its own or an agent's (`RunPlan.member_layout`), started after the
host's agents.

`Host` is plain Python: `LocalTrainers` keeps its hosts in this process, and the Ray wrapper
(`agent_trainer.actor`) puts each in an actor of its own. Either way a call names the agent it is for and an
`Agent` method; the agent runs it inside its trainer's `selected` context (an adapter agent's adapter and
RNG state). A host's agents answer one call at a time, so they never see each other's adapter or RNG state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from agent_trainer.adapters import AdapterTrainer, SharedBase, engine_slots
from agent_trainer.agent import Agent, Served
from agent_trainer.critic import Critic
from agent_trainer.critic_trainer import CriticTrainer
from agent_trainer.dispatch import dispatch_of
from agent_trainer.handle import TrainerStartError
from agent_trainer.trainer import AgentTrainer
from protocols.config import RunConfig, agent_resources
from protocols.errors import describe
from protocols.plan import RunPlan


class Host:
    """The trainers of one host's agents, then its critics; adapter agents among them share one base model."""

    def __init__(self, host: str, config: RunConfig, plan: RunPlan, updates: dict[str, int],
                 where: str = "this machine"):
        """`plan`: `config`'s (`protocols.plan`); `updates`: agent -> the updates it is scheduled for."""
        self.name = host
        self.agents = plan.member_layout[host]
        indices = {name: i for i, name in enumerate(config.agents)}  # seeds follow the declaration order
        base = (SharedBase(engine_slots=host_engine_slots(config, [a for a in self.agents if a in indices]))
                if any(config.agents[a].adapter is not None for a in self.agents if a in indices) else None)
        self.trainers: dict[str, Any] = {}
        self.served: dict[str, Served] = {}
        for name in self.agents:
            if name in indices:
                self.trainers[name] = start_trainer(name, config, plan, indices[name], updates[name], where=where,
                                                    base=base)
                self.served[name] = Agent(self.trainers[name])
            else:  # a critic: after the agents, whose model a head may sit on
                self.trainers[name] = start_critic(name, config, plan, self.trainers)
                self.served[name] = Critic(self.trainers[name])

    def call(self, member: str, method: Callable, *args: Any) -> Any:
        """Run `method` (a method of what `member` is served as, which declares its dispatch) for `member`."""
        dispatch_of(method)
        return method(self.served[member], *args)


def host_engine_slots(config: RunConfig, agents: list[str]):
    """The LoRA slots (`adapters.engine_slots`) of the vLLM engine that a host's adapter `agents` sampling with vLLM
    in the host share, or None where none does."""
    users = [config.agents[a] for a in agents if config.agents[a].adapter is not None
             and config.agents[a].rollout.engine == "vllm" and config.agents[a].rollout.placement == "colocated"]
    return engine_slots(users) if users else None


def start_critic(name: str, config: RunConfig, plan: RunPlan, trainers: dict[str, Any]):
    """The trainer of critic `name`, on the model of the agent that hosts it (`critic.model: agent`, an agent
    of this host) or an LM of its own; any failure becomes a one-line TrainerStartError."""
    critic = plan.critic
    agent = trainers[plan.critic_host_agents[name]] if critic.model == "agent" else None
    try:
        return CriticTrainer(name, critic, seed=config.train.seed + 10_000 + list(plan.critic_members).index(name),
                             total_updates=config.train.steps,
                             agent=agent)
    except Exception as exc:
        raise TrainerStartError(f"critic {name!r} could not start: {describe(exc)}") from exc


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


def start_trainer(name: str, config: RunConfig, plan: RunPlan, index: int, total_updates: int,
                  where: str = "this machine", base: SharedBase | None = None) -> AgentTrainer:
    """The trainer of agent `name`, of its host kind (an adapter agent on `base`, the host's shared base
    model; else a full-model agent); any failure becomes a one-line TrainerStartError. `where` names the
    node in messages."""
    problem = missing_model_path(name, config, where)
    if problem:
        raise TrainerStartError(problem)
    agent = config.agents[name].model_copy(update={"resources": agent_resources(config, name)})  # a shared host's
    kwargs = dict(seed=config.train.seed + index, total_updates=total_updates,
                  trainable=name not in config.schedule.frozen, staleness_bound=plan.staleness_bounds[name])
    kwargs["kv_cache_sequences"] = plan.engine_cache_sizes.get(name)
    try:
        if agent.adapter is not None:
            trainer = AdapterTrainer(name, agent, config.algorithm, base=base, **kwargs)
        else:
            trainer = AgentTrainer(name, agent, config.algorithm, **kwargs)
    except Exception as exc:
        raise TrainerStartError(f"agent {name!r} could not start: {describe(exc)}") from exc
    trainer.where = where
    return trainer
