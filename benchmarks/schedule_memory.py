"""Schedule-aware optimizer memory: N agents trained round robin on one machine, with each agent's AdamW state kept
resident (`agents.NAME.optimizer.offload: off`) and released between its updates (`auto`), side by side.

    python benchmarks/schedule_memory.py [--model builtin:smollm2-135m-instruct] [--agents 4] [--adapters 8]
                                         [--growth 2,4,8] [--steps 6] [--rounds 1] [--ray] [--batch 2] [--group 2]
                                         [--tokens 8] [--rank 16]

Each run is a fresh process (Ray: with its actors), the settings in alternating order (off, on, on, off, ...,
`--rounds` pairs). Full-model agents have a host each; adapter agents (LoRA of rank `--rank` on every linear layer)
share one host and its base model. Measured: the peak PSS of the run's process tree (the sum of
/proc/PID/smaps_rollup's Pss over the process and its descendants, sampled every `--interval` seconds), and the
median seconds per step after the first. `--steps` must exceed every agent count: in fewer steps round robin updates
only some of the agents, and the runs with the feature off would hold fewer optimizer states than a longer run.

Printed: a row per run; with `--growth`, a table of every count of full-model and adapter agents, off and on, and
the growth per added agent (least-squares slope over the counts); then `schedule-aware memory, K adapter agents:
PSS ratio R, step ratio S` (`--adapters K`, 0: not run) and last `schedule-aware memory: PSS ratio R, step ratio S`
for `--agents` full-model agents, on / off (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def child(args) -> dict:
    """One run of the given setting in this process: seconds of each step."""
    import bench_common as bc
    from orchestrator.coordinator import Coordinator
    from protocols.config import validate_config

    config = bc.marsi_config(num_agents=args.agents, model=args.model, batch_size=args.batch, group=args.group,
                             tokens=args.tokens, steps=args.steps, ray=args.ray, lr=1e-5)
    raw = config.model_dump(mode="json")
    raw["schedule"] = {"kind": "round_robin"}
    for agent in raw["agents"].values():
        agent["optimizer"]["offload"] = args.child
        if args.kind == "adapter":
            agent.update(adapter={"rank": args.rank, "alpha": 2 * args.rank}, host="shared")
    if args.kind == "adapter":
        raw["hosts"] = {"shared": {"resources": {"num_cpus": 1.0}}}
    with Coordinator(validate_config(raw, source="<benchmark>")) as coord:
        history = coord.run()
    return {"step_s": [m["time/step"] for m in history]}


def tree_pss(root: int) -> int:
    """PSS in bytes of process `root` and its descendants (0 for a process gone meanwhile)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += parents.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


def measure(args, setting: str, kind: str, agents: int) -> dict:
    """Run `setting` for `agents` agents of `kind` in a child process; its peak tree PSS and its steps' seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", setting, "--out", str(out), "--model", args.model,
                   "--kind", kind, "--agents", str(agents), "--steps", str(args.steps), "--batch", str(args.batch),
                   "--group", str(args.group), "--tokens", str(args.tokens), "--rank", str(args.rank),
                   *(["--ray"] if args.ray else [])]
        proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(HERE.parent)}, cwd=HERE.parent)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_pss(proc.pid))
            time.sleep(args.interval)
        if proc.returncode != 0:
            raise SystemExit(f"schedule_memory: the {setting} run failed (exit {proc.returncode})")
        result = json.loads(out.read_text())
    steps = result["step_s"][1:] or result["step_s"]
    return {"peak_pss": peak, "step_s": statistics.median(steps)}


def compare(args, kind: str, agents: int) -> dict[str, dict]:
    """`agents` agents of `kind`, off and on, `--rounds` pairs in alternating order: the medians of each setting."""
    results: dict[str, list[dict]] = {"off": [], "auto": []}
    for r in range(args.rounds):
        for setting in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
            row = measure(args, setting, kind, agents)
            results[setting].append(row)
            print(f"{agents} {kind} agents, offload {setting:4s}: peak PSS {row['peak_pss'] / 2**30:.2f} GiB, "
                  f"{row['step_s']:.2f} s/step", flush=True)
    return {s: {"peak_pss": statistics.median(r["peak_pss"] for r in rows),
                "step_s": statistics.median(r["step_s"] for r in rows)} for s, rows in results.items()}


def ratios(pair: dict[str, dict]) -> str:
    return (f"PSS ratio {pair['auto']['peak_pss'] / pair['off']['peak_pss']:.2f}, "
            f"step ratio {pair['auto']['step_s'] / pair['off']['step_s']:.2f}")


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def growth_table(measured: dict[tuple[str, int], dict[str, dict]], counts: list[int]) -> None:
    """The table of every (kind, count) off and on, and per kind and setting the growth per added agent."""
    print("\n| agents | kind | peak PSS off (GiB) | peak PSS on (GiB) | PSS on/off | s/step off | s/step on | step on/off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind in ("full", "adapter"):
        for n in counts:
            off, on = measured[kind, n]["off"], measured[kind, n]["auto"]
            print(f"| {n} | {kind} | {off['peak_pss'] / 2**30:.2f} | {on['peak_pss'] / 2**30:.2f} | "
                  f"{on['peak_pss'] / off['peak_pss']:.2f} | {off['step_s']:.2f} | {on['step_s']:.2f} | "
                  f"{on['step_s'] / off['step_s']:.2f} |")
    print("\nGrowth per added agent (least-squares slope over " + ", ".join(map(str, counts)) + " agents):")
    for kind in ("full", "adapter"):
        for setting in ("off", "auto"):
            rows = [measured[kind, n][setting] for n in counts]
            print(f"  {kind:7s} offload {setting:4s}: {slope(counts, [r['peak_pss'] / 2**30 for r in rows]):+.3f} GiB, "
                  f"{slope(counts, [r['step_s'] for r in rows]):+.3f} s/step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--agents", type=int, default=4, help="full-model agents of the last line")
    p.add_argument("--adapters", type=int, default=0, help="adapter agents on one host of the line above (0: none)")
    p.add_argument("--growth", default="", help="counts of agents to run of both kinds, e.g. 2,4,8 (a table)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs, off and on in alternating order")
    p.add_argument("--ray", action="store_true", help="trainers as Ray actors (default: in-process)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the adapter agents")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between PSS samples")
    p.add_argument("--child", choices=("off", "auto"), help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=("full", "adapter"), default="full", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        Path(args.out).write_text(json.dumps(child(args)))
        return
    counts = sorted({int(c) for c in args.growth.split(",") if c.strip()})
    most = max([*counts, args.agents, args.adapters])
    if args.steps <= most:
        p.error(f"--steps {args.steps} must exceed the largest agent count, {most}: round robin updates only "
                f"{args.steps} of {most} agents in {args.steps} steps, so the runs with the feature off would hold fewer "
                "optimizer states than any longer run does")
    import bench_common as bc

    print(bc.machine_line())
    print(f"{args.model}, round robin, {args.steps} steps, {'Ray actors' if args.ray else 'in-process'}; batch "
          f"{args.batch} x {args.group}, {args.tokens} tokens; adapters of rank {args.rank}")
    wanted = {("full", n) for n in counts} | {("adapter", n) for n in counts} | {("full", args.agents)}
    if args.adapters:
        wanted.add(("adapter", args.adapters))
    measured = {key: compare(args, *key) for key in sorted(wanted, key=lambda k: (k[1], k[0]))}
    if counts:
        growth_table(measured, counts)
    if args.adapters:
        print(f"schedule-aware memory, {args.adapters} adapter agents: {ratios(measured['adapter', args.adapters])}")
    print(f"schedule-aware memory: {ratios(measured['full', args.agents])}")


if __name__ == "__main__":
    main()
