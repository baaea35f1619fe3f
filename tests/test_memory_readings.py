"""Each step's measured peak memory (agent_trainer/process_memory.py, `memory/peak_mib/...` in the metrics): a
reading is the peak since the one before, members that share a process share its reading, and data-parallel
workers' readings add up."""

from __future__ import annotations

import os

from agent_trainer import process_memory
from orchestrator.steplog import computed, memory_metrics
from protocols.messages import MemoryReading

MiB = 2**20


def test_a_reading_is_the_peak_since_the_one_before_and_repeats_within_a_step():
    process_memory.reading(0)
    block = bytearray(300 * MiB)  # touched: resident
    del block
    during = process_memory.reading(1)
    after = process_memory.reading(2)  # nothing allocated since the reading of step 1
    assert during.peak_bytes - after.peak_bytes > 200 * MiB
    assert during.processes == [os.getpid()]
    assert process_memory.reading(2) is after  # a second member of this process, same step: the same reading


def test_members_of_one_process_are_one_key_and_workers_add_up():
    one = MemoryReading(processes=[11], peak_bytes=100 * MiB)
    workers = MemoryReading.concat([MemoryReading(processes=[12], peak_bytes=200 * MiB, device_peak_bytes=5 * MiB),
                                    MemoryReading(processes=[13], peak_bytes=300 * MiB, device_peak_bytes=7 * MiB)])
    assert workers.processes == [12, 13] and workers.peak_bytes == 500 * MiB and workers.device_peak_bytes == 12 * MiB
    metrics = memory_metrics({"a": one, "b": one, "dp": workers, "critic": one})
    assert metrics == {"memory/peak_mib/a+b+critic": 100.0, "memory/peak_mib/dp": 500.0,
                       "memory/device_peak_mib/dp": 12.0}


def test_identical_runs_are_compared_without_what_they_measured():
    row = {"step": 1, "loss/a": 0.5, "time/step": 2.0, "memory/peak_mib/a": 300.0}
    assert computed(row) == {"step": 1, "loss/a": 0.5}
