"""A policy version from learner to rollout engine of its own, against one copy of the same bytes in memory.

    python benchmarks/weight_transfer.py [--model builtin:smollm2-135m-instruct] [--repeats 5] [--rank 16]

`rollout.placement: separate` puts an agent's engine in a Ray actor of its own; after every update the learner
publishes its weights and the engine takes the version a generate names (`RayTrainers._publish`, `_sync_engine`).
One transfer here is exactly that pair of calls, timed from the publish to the engine holding the version, the
engine made to forget what it holds first, by either `rollout.weight_transfer`:

- `group`: the learner broadcasts its live tensors over a gloo group of the two processes, into the engine's own
  (`agent_trainer.weight_channel`); the publish only records the version.
- `store`: the learner copies its weights to the CPU and Ray's object store; the engine reads them from the store
  and loads them into its model.

Two agents, each run alone: a full model (every weight) and an adapter agent (LoRA of `--rank` on every linear
layer: only the adapter's tensors travel).

The floor is one copy of the same tensors in one process (`dst.copy_(src)` for each, one thread, the destination
written before so no page is new; a tied embedding once): the least a transfer of those bytes costs. Beside it,
`calls`: the median of one call of nothing (Ray's `__ray_ready__`) to the learner and one to the engine, at once,
the driver waiting for both, as `_send` waits for its pair: the least any transfer the driver starts costs,
whatever its bytes. Printed per agent and transfer: tensors, bytes, the median transfer, the median copy, their
ratio, and the calls. Last line: `weight transfer / one copy: full R, adapter R` for the group (the default), the
object store's in brackets.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray  # noqa: E402
import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from agent_trainer import weight_wire  # noqa: E402
from agent_trainer.agent import Agent  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402
from protocols.config import validate_config  # noqa: E402

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config(model: str, adapter_rank: int | None, transfer: str):
    raw = bc.marsi_config(num_agents=1, model=model, steps=1, ray=True, num_cpus=0.5, ray_cpus=1.0).model_dump()
    agent = raw["agents"]["a0"]
    agent["rollout"] = {"placement": "separate", "resources": {"num_cpus": 0.5}, "weight_transfer": transfer}
    if adapter_rank:
        agent["adapter"] = {"rank": adapter_rank, "alpha": 2 * adapter_rank, "target_modules": LINEAR}
    return validate_config(raw)


def copy_seconds(tensors: dict[str, torch.Tensor], repeats: int) -> float:
    """Median seconds of one `copy_` of every tensor into a same-shaped destination already written once."""
    src = {k: v.clone() for k, v in tensors.items()}
    dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for k, v in src.items():
            dst[k].copy_(v)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def untied(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` without a tied output layer: it arrives from the store as an array of its own, equal to the
    embedding, where the model holds (and the weight channel sends) one tensor."""
    embedding = next((t for n, t in tensors.items() if n.endswith("embed_tokens.weight")), None)
    return {n: t for n, t in tensors.items()
            if not (n.endswith("lm_head.weight") and embedding is not None and torch.equal(t, embedding))}


def measure(model: str, adapter_rank: int | None, transfer: str, repeats: int) -> dict:
    with Coordinator(config(model, adapter_rank, transfer)) as coord:
        pool, agent = coord.pool, "a0"
        said = pool.start_info[agent]["weight_transfer"]
        if (transfer == "group") != said.startswith("a gloo group"):
            raise SystemExit(f"weight_transfer {transfer}: the run took its weights by {said}")
        tensors = untied(weight_wire.unpack(pool.ask(Agent.published_weights, [agent])[agent]))
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        times = []
        for _ in range(repeats + 1):  # the learner's version 0 each time, the engine made to forget it before
            pool.engine_version[agent] = None
            start = time.perf_counter()
            pool._publish([agent], {agent: 0})
            pool._sync_engine(agent, 0)
            times.append(time.perf_counter() - start)
        actors = [pool.workers[agent][0], pool.engines[agent]]
        calls = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            ray.get([actor.__ray_ready__.remote() for actor in actors])
            calls.append(time.perf_counter() - start)
        floor = copy_seconds(tensors, repeats)
    seconds = statistics.median(times[1:])  # the first pays for warming the store
    return {"bytes": size, "tensors": len(tensors), "transfer": seconds, "copy": floor,
            "calls": statistics.median(calls[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16, help="the adapter agent's LoRA rank")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"weight transfer, learner -> engine of its own; before: {bc.load_line()}")
    print(bc.machine_line())
    rows = {(name, transfer): measure(args.model, rank, transfer, args.repeats)
            for name, rank in (("full", None), ("adapter", args.rank)) for transfer in ("group", "store")}
    print(f"after: {bc.load_line()}")
    print(f"{'agent':8s} {'transfer':9s} {'tensors':>8s} {'MB':>9s} {'transfer s':>11s} {'one copy s':>11s} "
          f"{'ratio':>7s} {'calls s':>8s}")
    for (name, transfer), r in rows.items():
        print(f"{name:8s} {transfer:9s} {r['tensors']:8d} {r['bytes'] / 1e6:9.1f} {r['transfer']:11.4f} "
              f"{r['copy']:11.4f} {r['transfer'] / r['copy']:7.1f} {r['calls']:8.4f}")
    ratio = {key: r["transfer"] / r["copy"] for key, r in rows.items()}
    print("weight transfer / one copy: " + ", ".join(f"{n} {ratio[n, 'group']:.1f}" for n in ("full", "adapter"))
          + " (object store: " + ", ".join(f"{n} {ratio[n, 'store']:.1f}" for n in ("full", "adapter")) + ")")


if __name__ == "__main__":
    main()
