"""The peak memory of this process between two readings, for the run's `memory/peak_mib/...` metrics.

On Linux the resident set's high-water mark (`VmHWM` in /proc/self/status) is read and then reset to the current
resident set (writing 5 to /proc/self/clear_refs), so each reading is the peak since the one before. Where that is
not possible the peak since the process started (`ru_maxrss`) is read instead. On a GPU the peak torch allocated
is read and reset the same way.

Agents that share a process (adapter agents on one host; every agent of a run without Ray) all ask for the
reading of a step: the first asking reads and resets, the others get the same reading, so none sees a peak
another one's reset cut short.
"""

from __future__ import annotations

import os
import re
import resource
import sys
import threading
from pathlib import Path

from protocols.messages import MemoryReading

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


class _Readings:
    """The reading of this process's latest step: agents sharing the process all get it for that step."""

    def __init__(self):
        self.lock = threading.Lock()
        self.step: int | None = None
        self.last: MemoryReading | None = None

    def of(self, step: int) -> MemoryReading:
        with self.lock:
            if self.last is None or self.step != step:
                self.step, self.last = step, MemoryReading(processes=[os.getpid()], peak_bytes=_resident_peak(),
                                                           device_peak_bytes=_device_peak())
            return self.last


_readings = _Readings()


def reading(step: int) -> MemoryReading:
    """This process's peak memory since the reading of an earlier step (the same reading again for `step`)."""
    return _readings.of(step)


def _resident_peak() -> int:
    try:
        found = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
        if found:
            peak = int(found.group(1)) * 1024
            _CLEAR.write_text("5")  # the high-water mark back to the current resident set
            return peak
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # since the process started
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _device_peak() -> int | None:
    torch = sys.modules.get("torch")  # a process that never loaded torch has no GPU memory of its own
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    peak = sum(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count()))
    for d in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(d)
    return peak
