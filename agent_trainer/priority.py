"""How a rollout engine apart yields the cores it shares with its learner (`rollout.nice`,
`RunPlan.engine_priority`, an `EnginePriority`).

Linux keeps a thread's niceness and scheduling class per thread, and a new thread starts with its creator's.
`lower` sets every thread the process has when it is called, so the thread that later runs the engine's calls (Ray
runs an actor's calls on a thread of its own) and every thread those start are lowered too.

- **`niceness` n**: n added to the niceness, which the system caps at 19. Ray starts its workers at 15, so an
  engine there ends at most 4 below its learner, and the learner's update still yields it a share of a core
  (measured: 7-14% slower than alone, benchmarks/RESULTS.md).
- **`idle`**: Linux's idle scheduling class (SCHED_IDLE): the engine runs on the cores no other thread of normal
  class wants, whatever their niceness, so an update beside it runs as if alone, and the engine takes every cycle
  the update leaves. Where the class does not exist (not Linux), niceness 19.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocols.config import EnginePriority


def _threads() -> list[int]:
    """The ids of this process's threads (Linux), else [0]: the caller."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def lower(setting: EnginePriority) -> None:
    """Lower this process's priority as `setting` says, every thread of it."""
    idle = setting.idle and hasattr(os, "SCHED_IDLE")
    added = 19 if setting.idle and not idle else setting.niceness  # no idle class: the lowest niceness
    for thread in _threads():
        try:
            if added:
                os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + added))
            if idle:
                os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def current() -> dict[str, int | str]:
    """This thread's niceness and scheduling class (`idle` or `normal`), as an actor's `info` reports them."""
    idle = hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(0) == os.SCHED_IDLE
    return {"nice": os.getpriority(os.PRIO_PROCESS, 0), "scheduler": "idle" if idle else "normal"}


def described(priority: dict[str, int | str]) -> str:
    """`in the idle class` or `at niceness N`: how the start line names a process's priority (`current`)."""
    return "in the idle class" if priority["scheduler"] == "idle" else f"at niceness {priority['nice']}"
