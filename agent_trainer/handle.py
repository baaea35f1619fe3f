"""The handle: the typed interface through which the coordinator and evaluation reach one agent, and the
pool that hands handles out.

`AgentHandle` is the same whether the agent runs in this process, in a Ray actor, on K data-parallel workers
or as an adapter on a shared host. A pool (`group.LocalTrainers`, in-process; `actor.RayTrainers`, Ray
actors) is a `TrainerPool`: `pool[agent]` is a handle, and `pool.each(Agent.generate, {agent: request})`
fans one call out to several agents at once (Ray: every `.remote()` first, then one gather) and returns
each agent's answer. The methods and how each fans out over an agent's workers are `agent_trainer.agent.Agent`'s.

No torch here: the coordinator imports this module.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, Iterable, Mapping, Protocol, TypeVar

from agent_trainer.agent import Agent
from protocols.errors import UserError
from protocols.messages import (
    GenerateRequest, GenerateResult, LoadRequest, ProbeRequest, SaveRequest, ScoreRequest, StoredFiles, UpdateRequest,
    UpdateResult, WeightDigests,
)

A = TypeVar("A")
R = TypeVar("R")


class TrainerStartError(UserError, RuntimeError):
    """A trainer could not start (its model did not load, ...); the message names the agent and the fix."""


class PlacementError(UserError, RuntimeError):
    """The cluster cannot hold the trainers; the message lists what was asked and what is free."""


class TrainerFailure(RuntimeError):
    """A trainer call failed. `recoverable`: the process died or hung, so a restart from a checkpoint
    may help; otherwise the trainer raised, which a restart would only repeat."""

    def __init__(self, agent: str, method: str, reason: str, recoverable: bool):
        super().__init__(f"agent {agent!r}: {method} failed: {reason}")
        self.agent, self.method, self.reason, self.recoverable = agent, method, reason, recoverable


class AgentHandle(Protocol):
    """One agent, wherever and however it runs. Methods, their messages and their fan-out over the
    agent's workers: `agent_trainer.agent.Agent`."""

    def generate(self, request: GenerateRequest) -> GenerateResult: ...
    def update(self, request: UpdateRequest) -> UpdateResult: ...
    def save(self, request: SaveRequest) -> StoredFiles: ...
    def load(self, request: LoadRequest) -> str | None: ...
    def probe(self, request: ProbeRequest) -> bool: ...
    def digest(self) -> str: ...
    def weight_digests(self) -> WeightDigests: ...
    def score(self, request: ScoreRequest) -> list[list[float]]: ...
    def per_token_logps(self, request: ScoreRequest) -> list[list[float]]: ...


class TrainerPool(abc.ABC):
    """The agents of a run, each behind a handle. `call_timeout` bounds a call (None: no bound);
    `checkpoint_timeout` a save, load or probe. `start_info` is `info()` as the pool started."""

    agents: list[str]
    call_timeout: float | None = None
    checkpoint_timeout: float | None = None
    start_info: dict[str, dict[str, Any]]

    def __getitem__(self, agent: str) -> AgentHandle:
        if agent not in self.agents:
            raise KeyError(f"no agent {agent!r} in this pool; agents: {', '.join(self.agents)}")
        return PoolHandle(self, agent)

    def each(self, method: Callable[[Agent, A], R], arguments: Mapping[str, A], *,
             timeout: float | None = None) -> dict[str, R]:
        """`method` (an `Agent` method) for every agent named in `arguments`, with its argument, all agents
        at once; each agent's answer. A dead, hung or raising agent is a `TrainerFailure`."""
        return self._fan_out(method, {agent: (argument,) for agent, argument in arguments.items()}, timeout)

    def ask(self, method: Callable[[Agent], R], agents: Iterable[str], *, timeout: float | None = None) -> dict[str, R]:
        """`method` (an `Agent` method without an argument) for each of `agents`, all at once."""
        return self._fan_out(method, {agent: () for agent in agents}, timeout)

    @abc.abstractmethod
    def _fan_out(self, method: Callable, calls: dict[str, tuple], timeout: float | None) -> dict[str, Any]:
        """Run `method(agent, *args)` for each agent's `args` per `dispatch_of(method)`; their answers."""

    @abc.abstractmethod
    def info(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Per agent: its process (pid), device, engine, precision, load seconds, ... and, with Ray, its node
        and every worker's under `workers`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop every agent's trainer."""


class PoolHandle:
    """An `AgentHandle` on one agent of a pool: each method is one `pool.each` call for that agent."""

    def __init__(self, pool: TrainerPool, agent: str):
        self.pool, self.agent = pool, agent

    def _one(self, method: Callable, *args, timeout: float | None) -> Any:
        return self.pool._fan_out(method, {self.agent: args}, timeout)[self.agent]

    def generate(self, request: GenerateRequest) -> GenerateResult:
        return self._one(Agent.generate, request, timeout=self.pool.call_timeout)

    def update(self, request: UpdateRequest) -> UpdateResult:
        return self._one(Agent.update, request, timeout=self.pool.call_timeout)

    def save(self, request: SaveRequest) -> StoredFiles:
        return self._one(Agent.save, request, timeout=self.pool.checkpoint_timeout)

    def load(self, request: LoadRequest) -> str | None:
        return self._one(Agent.load, request, timeout=self.pool.checkpoint_timeout)

    def probe(self, request: ProbeRequest) -> bool:
        return self._one(Agent.probe, request, timeout=self.pool.checkpoint_timeout)

    def digest(self) -> str:
        return self._one(Agent.digest, timeout=self.pool.call_timeout)

    def weight_digests(self) -> WeightDigests:
        return self._one(Agent.weight_digests, timeout=self.pool.call_timeout)

    def score(self, request: ScoreRequest) -> list[list[float]]:
        return self._one(Agent.score, request, timeout=self.pool.call_timeout)

    def per_token_logps(self, request: ScoreRequest) -> list[list[float]]:
        return self._one(Agent.per_token_logps, request, timeout=self.pool.call_timeout)

    def info(self) -> dict[str, Any]:
        return self.pool.info(self.pool.call_timeout)[self.agent]
