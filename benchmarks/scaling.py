"""marsi with 1, 2 and 4 agents (tiny model) and growing episodes per step, side by side: seconds per
step, where they go, the coordinator's own time, and resident memory per trainer actor.

    python benchmarks/scaling.py [--agents 1,2,4] [--batch 4,8,16,32] [--group 4] [--tokens 4]
                                 [--block 2] [--repeats 3] [--model builtin:tiny]

Task: `bench_common.TeamEnv` with one role per agent (one turn, all act at once, shared reward), all
agents trained every step. One Ray cluster holds one Coordinator per agent count, all started up
front; every trainer actor has num_cpus 1 (one torch thread), and the cluster declares as many
logical CPUs as there are actors, so with 4 agents on a 2-core machine the actors share the cores.
Episodes per step = batch x group; between blocks the script sets the coordinator's
`config.train.batch_size`, then steps it with `run(until=...)`. Blocks of `--block` steps alternate
over (agents, episodes) and repeat `--repeats` times (the order rotates); figures are medians over repeats.

Columns: s/step; generate and update as the driver sees them (wall time of the fan-out calls);
calls = that wall time minus the slowest trainer's own seconds (Ray transport, (de)serialisation,
scheduling, waiting for the busiest actor when agents share cores); coordinator = the rest of the step
(rollout bookkeeping, env, advantages, Experience messages, metrics), also per action (episodes x agents).
"""

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_common as bc  # noqa: E402
from agent_trainer.actor import init_ray  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402
from protocols.config import RayConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", default="1,2,4")
    parser.add_argument("--batch", default="4,8,16,32", help="samples per step; episodes = batch x group")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--block", type=int, default=2, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model", default="builtin:tiny")
    args = parser.parse_args()
    agent_counts = [int(a) for a in args.agents.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    cells = [(n, b) for n in agent_counts for b in batches]
    steps = args.repeats * len(batches) * args.block + 1  # + 1 untimed warm-up step per coordinator
    print(f"marsi scaling on {args.model}: agents {agent_counts}, episodes per step "
          f"{[b * args.group for b in batches]}, {args.tokens} new tokens, one torch thread per actor; "
          f"{args.repeats} repeats of {args.block}-step blocks")
    print(f"before: {bc.load_line()}")
    print(bc.machine_line())

    import ray

    init_ray(RayConfig(num_cpus=sum(agent_counts)))
    times = {cell: [] for cell in cells}
    parts = {cell: {k: [] for k in ("generate", "update", "calls", "coordinator")} for cell in cells}
    try:
        with ExitStack() as stack:
            start = time.perf_counter()
            coords, calls = {}, {}
            for n in agent_counts:
                config = bc.marsi_config(num_agents=n, model=args.model, batch_size=max(batches), group=args.group,
                                         tokens=args.tokens, lr=args.lr, steps=steps, ray=True, dataset_size=64)
                coords[n] = stack.enter_context(Coordinator(config))
                calls[n] = bc.CallTimes(coords[n].pool)
                coords[n].run(until=1)  # warm-up, untimed
            print(f"set-up ({sum(agent_counts)} actors): {time.perf_counter() - start:.1f} s")
            for r in range(args.repeats):
                order = cells[r * len(batches) % len(cells):] + cells[:r * len(batches) % len(cells)]
                for n, b in order:
                    coord, call = coords[n], calls[n]
                    coord.config.train.batch_size = b
                    call.reset()
                    with bc.timed(times[n, b], divide_by=args.block):
                        history = coord.run(until=coord.state.step + args.block)
                    cell = parts[n, b]
                    cell["generate"].append(sum(m["time/generate"] for m in history) / args.block)
                    cell["update"].append(sum(m["time/update"] for m in history) / args.block)
                    cell["calls"].append(sum(call.wall.values()) / args.block - sum(call.trainer.values()) / args.block)
                    cell["coordinator"].append(sum(m["time/coordinator"] for m in history) / args.block)
                print(f"repeat {r + 1}/{args.repeats} done", flush=True)
            memory = {}
            for n, coord in coords.items():
                memory[n] = [bc.rss_mb(i["pid"]) for i in coord.pool.info().values()]
            driver = bc.rss_mb(os.getpid())
    finally:
        ray.shutdown()
    print(f"after: {bc.load_line()}")

    print(f"\n{'agents':>6s} {'episodes':>8s} {'s/step':>7s} {'generate':>8s} {'update':>7s} {'calls':>7s} "
          f"{'coordinator':>11s} {'coord us/action':>15s}")
    for n, b in cells:
        episodes = b * args.group
        coordinator = bc.median(parts[n, b]["coordinator"])
        print(f"{n:6d} {episodes:8d} {bc.median(times[n, b]):7.3f} {bc.median(parts[n, b]['generate']):8.3f} "
              f"{bc.median(parts[n, b]['update']):7.3f} {bc.median(parts[n, b]['calls']):7.3f} {coordinator:11.4f} "
              f"{coordinator / (episodes * n) * 1e6:15.1f}")
    print(f"\nresident memory per trainer actor, MB now / peak (driver: {driver[0]:.0f} / {driver[1]:.0f}):")
    for n, rows in memory.items():
        print(f"  {n} agent(s): " + ", ".join(f"{now:.0f} / {peak:.0f}" for now, peak in rows))


if __name__ == "__main__":
    main()
