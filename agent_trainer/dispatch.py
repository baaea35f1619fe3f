"""How one agent's call fans out over its data-parallel workers, declared where each method is defined.

An agent with K workers (`agent_trainer.workers`) is one agent to everything above `agent_trainer/`. Each
method of `agent_trainer.agent.Agent` carries its `Dispatch` (`@register(Dispatch.ROWS)`, after verl's
`@register(dispatch_mode=...)`); a pool (in-process or Ray) reads it to choose the workers a call goes to
and to make the agent's one answer of theirs:

- `ROWS`: every worker gets the whole request and answers its share of the rows (`workers.share`); the
  shares are concatenated in worker order (the result type's `concat`).
- `RANK_ZERO`: worker 0 alone (the workers hold the same weights: one copy is written or read).
- `ALL_EQUAL`: every worker; their answers must agree (timings aside), else the call fails.
- `ALL_TRUE`: every worker answers yes or no; True only if each said yes (a storage probe).

A class whose public methods lack a declaration is refused when it is checked (`check_registered`), which
the pools do before they serve it: a new method cannot silently reach one worker only.
"""

from __future__ import annotations

import enum
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


def register(dispatch: Dispatch) -> Callable[[F], F]:
    """Declare how the decorated agent method fans out over the agent's workers."""
    if not isinstance(dispatch, Dispatch):
        raise TypeError(f"register: {dispatch!r} is not a Dispatch")

    def mark(method: F) -> F:
        method.__dispatch__ = dispatch
        return method

    return mark


def dispatch_of(method: Callable) -> Dispatch:
    """The declared dispatch of an agent method; TypeError for a method without one."""
    dispatch = getattr(method, "__dispatch__", None)
    if dispatch is None:
        raise TypeError(f"{getattr(method, '__qualname__', method)!r} declares no dispatch; decorate it with "
                        "@register(Dispatch.ROWS | RANK_ZERO | ALL_EQUAL | ALL_TRUE)")
    return dispatch


def check_registered(cls: type) -> type:
    """`cls` itself, once every public method of it declares its dispatch; TypeError naming the first that
    does not."""
    for klass in cls.__mro__[:-1]:  # its own methods and those it inherits
        for name, member in vars(klass).items():
            if callable(member) and not name.startswith("_"):
                dispatch_of(getattr(cls, name))
    return cls
