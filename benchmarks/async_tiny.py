"""Asynchronous rollouts with Ray: seconds per step for engines colocated and separate, K = 0 and 1, under
simultaneous and alternate schedules (2 agents, 2 turns, 4 x 4 episodes, 16 new tokens, each trainer and engine half
a core), with the step's generate, update and overlapped seconds.

    python benchmarks/async_tiny.py [--model builtin:tiny] [--engine hf|vllm] [--tokens 16] [--steps 14]
                                    [--cases simultaneous:colocated:0,...] [--dtype float32] [--adapters RANK]

`--cases`: the runs, each SCHEDULE:PLACEMENT:K (default: both schedules, each placement, K 0 and 1), a separate one
optionally SCHEDULE:separate:K:NICE (the engines' `rollout.nice`, 0-19 or idle; default `auto`: idle on CPU).
The last line compares the last case with the first: `separate / colocated s/step: R` when they are `alternate:separate:1` and
`alternate:colocated:0`, the target setting of separate engines (`--engine vllm`, SmolLM2). `--adapters RANK`: the
two agents are adapter agents of one shared host instead, its engine colocated (the host's process, 2 cores) or one
engine apart serving both adapters (host and engine 1 core each).

Seconds per step: from the steps' `time/end`, steps 4 to 12 of 14 (the pipeline filled, not yet draining).
The task is the tests' letter environment (tests/envs.py): only the timing matters here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from orchestrator.coordinator import Coordinator  # noqa: E402
from protocols.config import validate_config  # noqa: E402
from tests.envs import config  # noqa: E402


def run(placement: str, k: int, kind: str, args, nice: int | str | None = None) -> tuple[float, str]:
    raw = config(turns=2, ray=True, train={"steps": args.steps, "max_staleness": k, "batch_size": 4,
                                            "num_generations": 4}, schedule={"kind": kind})
    share = 1.0 if args.adapters else 0.5  # of the 2 cores: a host and its engine apart, or two agents' hosts
    if args.adapters:  # one host: 2 cores colocated, 1 core beside its engine apart's 1
        raw["hosts"] = {"h": {"resources": {"num_cpus": share if placement == "separate" else 2.0}}}
    for spec in raw["agents"].values():
        spec.update(model=args.model, dtype=args.dtype)
        spec["generation"] = {"max_completion_length": args.tokens}
        if args.adapters:
            del spec["resources"]
            spec.update(host="h", adapter={"rank": args.adapters, "alpha": 2 * args.adapters,
                                           "target_modules": "all-linear"})
        else:
            spec["resources"] = {"num_cpus": share}
        spec["rollout"] = {"placement": placement, "engine": args.engine,
                           **({"resources": {"num_cpus": share}} if placement == "separate" else {}),
                           **({"nice": nice} if nice is not None else {})}
    with Coordinator(validate_config(raw), None) as coord:
        history = coord.run()
    ends = [m["time/end"] for m in history]
    seconds = (ends[-3] - ends[3]) / (len(ends) - 6)
    middle = history[3:-2]
    mean = lambda key: statistics.fmean(m.get(key, 0.0) for m in middle)  # noqa: E731
    niceness = f" nice {nice}" if nice is not None else ""
    return seconds, (f"{kind:12s} {placement:9s} K={k}{niceness}: {seconds:.3f} s/step, "
                     f"generate {mean('time/generate'):.3f}, update {mean('time/update'):.3f}, "
                     f"overlap {mean('time/overlap'):.3f}")


CASES = ",".join(f"{kind}:{placement}:{k}" for kind in ("simultaneous", "alternate")
                 for placement, k in (("colocated", 0), ("colocated", 1), ("separate", 0), ("separate", 1)))


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--steps", type=int, default=14, help="at least 8: steps 4 .. N-2 are timed")
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--adapters", type=int, default=0, metavar="RANK",
                        help="the two agents as LoRA adapters of this rank on one shared host (2 cores colocated; "
                             "1 core beside one engine apart of 1 core that serves both adapters)")
    args = parser.parse_args()
    if args.steps < 8:
        parser.error(f"--steps {args.steps}: at least 8 (steps 4 .. N-2 are timed)")
    cases = [c.split(":") for c in args.cases.split(",")]
    for case in cases:
        if len(case) not in (3, 4) or case[1] not in ("colocated", "separate") or not case[2].isdigit() or (
                len(case) == 4 and (case[1] != "separate" or not (case[3].isdigit() or case[3] == "idle"))):
            parser.error(f"--cases: {':'.join(case)!r} is not SCHEDULE:colocated|separate:K or "
                         "SCHEDULE:separate:K:NICE (NICE 0-19 or idle)")
    cases = [(kind, placement, int(k), *(n if n == "idle" else int(n) for n in nice))
             for kind, placement, k, *nice in cases]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    agents = f"two adapter agents (rank {args.adapters}) on one host" if args.adapters else "two agents"
    print(f"{args.model}, {agents}, engine {args.engine}, {args.dtype}, {args.tokens} new tokens, {args.steps} steps")
    seconds = []
    for kind, placement, k, *nice in cases:
        took, line = run(placement, k, kind, args, *nice)
        seconds.append(took)
        print(line, flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    last, first = cases[-1], cases[0]
    print(f"{':'.join(map(str, last))} / {':'.join(map(str, first))} s/step: {seconds[-1] / seconds[0]:.2f}")


if __name__ == "__main__":
    main()
