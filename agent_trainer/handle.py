"""The handle: the typed interface through which the coordinator and evaluation reach one agent, and the
pool that hands handles out.

`AgentHandle` is the same whether the agent runs in this process, in a Ray actor, on K data-parallel workers
or as an adapter on a shared host; `CriticHandle` is a critic's. Both are generated from the methods the
served classes declare (`agent_trainer.agent.Agent`, `agent_trainer.critic.Critic`; `agent_trainer.dispatch`):
a method added there is on the handle, with its fan-out over workers and its timeout class. A pool
(`group.LocalTrainers`, in-process; `actor.RayTrainers`, Ray actors) is a `TrainerPool`: `pool[agent]` is a
handle, and `pool.each(Agent.generate, {agent: request})` fans one call out to several agents at once (Ray:
every `.remote()` first, then one gather) and returns each agent's answer.

No torch here: the coordinator imports this module.
"""

from __future__ import annotations

import abc
import enum
from typing import Any, Callable, Iterable, Mapping, TypeVar

from agent_trainer.agent import Agent
from agent_trainer.critic import Critic
from agent_trainer.dispatch import Timeout, declaration_of, declared_methods
from protocols.errors import UserError

A = TypeVar("A")
R = TypeVar("R")


class Declared(enum.Enum):
    TIMEOUT = "declared"


DECLARED = Declared.TIMEOUT
"""`each` / `ask` without a `timeout`: the method's declared timeout class's (`TrainerPool.timeout_of`)."""


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


class TrainerPool(abc.ABC):
    """The agents of a run, each behind a handle. `call_timeout` bounds a call (None: no bound);
    `checkpoint_timeout` a save, load or probe. `start_info` is `info()` as the pool started."""

    agents: list[str]
    call_timeout: float | None = None
    checkpoint_timeout: float | None = None
    start_info: dict[str, dict[str, Any]]

    critics: frozenset[str] | set[str] = frozenset()  # members served as a `Critic`; the rest are agents

    def __getitem__(self, member: str) -> PoolHandle:
        if member not in self.agents:
            raise KeyError(f"no agent {member!r} in this pool; agents: {', '.join(self.agents)}")
        return (CriticHandle if member in self.critics else AgentHandle)(self, member)

    def timeout_of(self, method: Callable) -> float | None:
        """The bound of a call of `method`: its declared timeout class's (`agent_trainer.dispatch.Timeout`)."""
        return self.checkpoint_timeout if declaration_of(method).timeout is Timeout.CHECKPOINT else self.call_timeout

    def each(self, method: Callable[[Any, A], R], arguments: Mapping[str, A], *,
             timeout: float | None | Declared = DECLARED) -> dict[str, R]:
        """`method` (a served method: `Agent`'s, `Critic`'s) for every member named in `arguments`, with its
        argument, all at once; each one's answer. Bounded by the method's declared timeout class unless
        `timeout` is given (None: no bound). A dead, hung or raising member is a `TrainerFailure`."""
        timeout = self.timeout_of(method) if timeout is DECLARED else timeout
        return self._fan_out(method, {agent: (argument,) for agent, argument in arguments.items()}, timeout)

    def ask(self, method: Callable[[Any], R], agents: Iterable[str], *,
            timeout: float | None | Declared = DECLARED) -> dict[str, R]:
        """`method` (a served method without an argument) for each of `agents`, all at once."""
        timeout = self.timeout_of(method) if timeout is DECLARED else timeout
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
    """A handle on one member of a pool: each method is one `pool._fan_out` call for that member, bounded by
    the method's declared timeout class. The methods are generated from a served class (`handle_class`)."""

    def __init__(self, pool: TrainerPool, member: str):
        self.pool, self.member = pool, member

    @property
    def agent(self) -> str:
        return self.member

    def info(self) -> dict[str, Any]:
        return self.pool.info(self.pool.call_timeout)[self.member]


def _handle_method(served: type, method: Callable) -> Callable:
    def call(self: PoolHandle, *args: Any) -> Any:
        return self.pool._fan_out(method, {self.member: args}, self.pool.timeout_of(method))[self.member]

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    call.__qualname__ = f"{served.__name__}Handle.{method.__name__}"
    call.__annotations__ = dict(getattr(method, "__annotations__", {}))
    return call


def handle_class(served: type) -> type[PoolHandle]:
    """The handle of members served as `served` (`Agent`, `Critic`): one method per method it declares
    (`agent_trainer.dispatch.register`), same name, same arguments."""
    methods = {name: _handle_method(served, method) for name, method in declared_methods(served).items()}
    return type(f"{served.__name__}Handle", (PoolHandle,), {"__doc__": f"A pool's handle on one {served.__name__}: "
                                                             f"{', '.join(methods)}.", **methods})


AgentHandle = handle_class(Agent)
CriticHandle = handle_class(Critic)
