"""What a pool needs to know of each method a host serves, declared where the method is defined: how one
member's call fans out over its data-parallel workers, which timeout bounds it, whether it goes to the agent's
rollout engine of its own, and whether it changes the weights that engine samples with.

An agent with K workers (`agent_trainer.workers`) is one agent to everything above `agent_trainer/`. Each
method of `agent_trainer.agent.Agent` carries its `Dispatch` (`@register(Dispatch.ROWS)`, after verl's
`@register(dispatch_mode=...)`); a pool (in-process or Ray) reads it to choose the workers a call goes to
and to make the agent's one answer of theirs:

- `ROWS`: every worker gets the whole request and answers its share of the rows (`workers.share`); the
  shares are concatenated in worker order (the result type's `concat`).
- `RANK_ZERO`: worker 0 alone (the workers hold the same weights: one copy is written or read).
- `ALL_EQUAL`: every worker; their answers must agree (timings aside), else the call fails.
- `ALL_TRUE`: every worker answers yes or no; True only if each said yes (a storage probe).

`@register(dispatch, timeout=..., engine=..., publishes=...)` also declares:

- `timeout`: `Timeout.CALL` (`train.call_timeout_s`, the default) or `Timeout.CHECKPOINT`
  (`train.checkpoint_timeout_s`: a save, load or probe); a pool bounds each call by its class.
- `engine`: the call goes to the agent's rollout engine of its own where it has one (`rollout.placement:
  separate`), which first takes the learner's weights of the version the request names.
- `publishes`: after the call, the Ray pool publishes the learner's weights for its engine:
  `Publish.UPDATED` under the policy version the result names, `Publish.RELOADED` under the version the
  learner reports (what was published before is forgotten).

The pools read these declarations (`declaration_of`) and nothing else: no method is told apart by its
identity or its name. A handle (`agent_trainer.handle`) is generated from a served class's declared methods.
A class whose public methods lack a declaration is refused when it is checked (`check_registered`), which
the pools do before they serve it: a new method cannot silently reach one worker only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

TIMINGS = frozenset({"seconds", "sync_seconds"})
"""Fields of a result that each worker measures for itself; `ALL_EQUAL` compares everything else."""


class WorkersDisagree(RuntimeError):
    """An `ALL_EQUAL` call's workers answered differently: they no longer hold the same agent."""


class Dispatch(enum.Enum):
    ROWS = "rows"
    RANK_ZERO = "rank_zero"
    ALL_EQUAL = "all_equal"
    ALL_TRUE = "all_true"

    @property
    def all_workers(self) -> bool:
        """Whether every worker gets the call (else worker 0 alone)."""
        return self is not Dispatch.RANK_ZERO

    def collect(self, answers: Sequence[Any]) -> Any:
        """The agent's answer from its workers' `answers`, in worker order."""
        if len(answers) == 1:
            return answers[0]
        if self is Dispatch.ROWS:
            return type(answers[0]).concat(answers)
        if self is Dispatch.ALL_TRUE:
            return all(answers)
        if self is Dispatch.ALL_EQUAL:
            first = _comparable(answers[0])
            for rank, answer in enumerate(answers[1:], 1):
                other = _comparable(answer)
                if other != first:
                    raise WorkersDisagree(f"worker {rank} of {len(answers)} answered {_difference(other, first)}")
        return answers[0]


class Timeout(enum.Enum):
    CALL = "call"  # train.call_timeout_s
    CHECKPOINT = "checkpoint"  # train.checkpoint_timeout_s


class Publish(enum.Enum):
    UPDATED = "updated"  # the learner's weights moved on: publish them under the result's `policy_version`
    RELOADED = "reloaded"  # the learner's weights were replaced: publish them under the version it reports


@dataclass(frozen=True)
class Declaration:
    """A served method's declaration (`register`); `name` is the method's, by which a host process finds it."""

    name: str
    dispatch: Dispatch
    timeout: Timeout = Timeout.CALL
    engine: bool = False
    publishes: Publish | None = None


def _comparable(answer: Any) -> Any:
    dump = getattr(answer, "model_dump", None)
    return dump(exclude=set(TIMINGS)) if dump is not None else answer


def _difference(other: Any, first: Any) -> str:
    """How an answer differs from worker 0's: the fields that differ, or the two answers."""
    if isinstance(other, dict) and isinstance(first, dict):
        keys = [k for k in first if other.get(k) != first[k]]
        return ", ".join(f"{k}={other.get(k)!r}" for k in keys) + " where worker 0 answered " + ", ".join(
            f"{k}={first[k]!r}" for k in keys)
    return f"{other!r} where worker 0 answered {first!r}"


def register(dispatch: Dispatch, *, timeout: Timeout = Timeout.CALL, engine: bool = False,
             publishes: Publish | None = None) -> Callable[[F], F]:
    """Declare how the decorated served method fans out over a member's workers, its timeout class, whether it
    goes to an agent's rollout engine of its own, and what it publishes to that engine."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register: {dispatch!r} is not a Dispatch")
    if not isinstance(timeout, Timeout) or not (publishes is None or isinstance(publishes, Publish)):
        raise TypeError(f"register: timeout {timeout!r} is not a Timeout or publishes {publishes!r} not a Publish")

    def mark(method: F) -> F:
        method.__declared__ = Declaration(method.__name__, dispatch, timeout, engine, publishes)
        return method

    return mark


def declaration_of(method: Callable) -> Declaration:
    """The declaration of a served method; TypeError for a method without one."""
    declared = getattr(method, "__declared__", None)
    if declared is None:
        raise TypeError(f"{getattr(method, '__qualname__', method)!r} declares no dispatch; decorate it with "
                        "@register(Dispatch.ROWS | RANK_ZERO | ALL_EQUAL | ALL_TRUE)")
    return declared


def dispatch_of(method: Callable) -> Dispatch:
    """The declared dispatch of a served method; TypeError for a method without one."""
    return declaration_of(method).dispatch


def declared_methods(cls: type) -> dict[str, Callable]:
    """Name -> method, for every public method `cls` serves (its own and those it inherits)."""
    names = dict.fromkeys(name for klass in reversed(cls.__mro__[:-1]) for name, member in vars(klass).items()
                          if callable(member) and not name.startswith("_"))
    return {name: getattr(cls, name) for name in names}


def check_registered(cls: type) -> type:
    """`cls` itself, once every public method of it declares its dispatch; TypeError naming the first that
    does not."""
    for klass in cls.__mro__[:-1]:  # its own methods and those it inherits
        for name, member in vars(klass).items():
            if callable(member) and not name.startswith("_"):
                dispatch_of(getattr(cls, name))
    return cls
