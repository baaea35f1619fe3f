"""Asynchronous rollouts on the tiny model with Ray: seconds per step for engines colocated and separate, K = 0
and 1, under simultaneous and alternate schedules (2 agents, 2 turns, 4 x 4 episodes, 16 new tokens, each trainer
and engine half a core), with the step's generate, update and overlapped seconds.

    python benchmarks/async_tiny.py

Seconds per step: from the steps' `time/end`, steps 4 to 12 of 14 (the pipeline filled, not yet draining).
The task is the tests' letter environment (tests/envs.py): only the timing matters here.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from orchestrator.coordinator import Coordinator  # noqa: E402
from protocols.config import validate_config  # noqa: E402
from tests.envs import config  # noqa: E402


def run(placement: str, k: int, kind: str) -> str:
    raw = config(turns=2, ray=True, train={"steps": 14, "max_staleness": k, "batch_size": 4, "num_generations": 4},
                 schedule={"kind": kind})
    for spec in raw["agents"].values():
        spec["generation"] = {"max_completion_length": 16}
        spec["resources"] = {"num_cpus": 0.5}
        spec["rollout"] = {"placement": placement, **({"resources": {"num_cpus": 0.5}} if placement == "separate" else {})}
    with Coordinator(validate_config(raw), None) as coord:
        history = coord.run()
    ends = [m["time/end"] for m in history]
    seconds = (ends[-3] - ends[3]) / (len(ends) - 6)
    middle = history[3:-2]
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for m in middle)  # noqa: E731
    return (f"{kind:12s} {placement:9s} K={k}: {seconds:.3f} s/step, generate {mean('time/generate'):.3f}, "
            f"update {mean('time/update'):.3f}, overlap {mean('time/overlap'):.3f}")


def main() -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for kind in ("simultaneous", "alternate"):
        for placement, k in (("colocated", 0), ("colocated", 1), ("separate", 0), ("separate", 1)):
            print(run(placement, k, kind), flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
