"""Schedule-aware optimizer memory: N agents trained round robin on one machine, with each agent's AdamW state kept
resident (`agents.NAME.optimizer.offload: off`) and released between its updates (`auto`), side by side.

    python benchmarks/schedule_memory.py [--model builtin:smollm2-135m-instruct] [--agents 4] [--steps 6]
                                         [--rounds 1] [--ray] [--batch 2] [--group 2] [--tokens 8]

Each run is a fresh process (Ray: with its actors), the settings in alternating order (off, on, on, off, ...,
`--rounds` pairs). Measured: the peak PSS of the run's process tree (the sum of /proc/PID/smaps_rollup's Pss over
the process and its descendants, sampled every `--interval` seconds), and the median seconds per step after the
first. Printed last: `schedule-aware memory: PSS ratio R, step ratio S`, on / off (medians over the rounds).
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


def measure(args, setting: str) -> dict:
    """Run `setting` in a child process; its peak tree PSS and its steps' seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--child", setting, "--out", str(out), "--model", args.model,
                   "--agents", str(args.agents), "--steps", str(args.steps), "--batch", str(args.batch),
                   "--group", str(args.group), "--tokens", str(args.tokens), *(["--ray"] if args.ray else [])]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=1, help="pairs of runs, off and on in alternating order")
    p.add_argument("--ray", action="store_true", help="trainers as Ray actors (default: in-process)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--group", type=int, default=2)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--interval", type=float, default=0.5, help="seconds between PSS samples")
    p.add_argument("--child", choices=("off", "auto"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        Path(args.out).write_text(json.dumps(child(args)))
        return
    import bench_common as bc

    print(bc.machine_line())
    print(f"{args.agents} agents of {args.model}, round robin, {args.steps} steps, "
          f"{'Ray actors' if args.ray else 'in-process'}; batch {args.batch} x {args.group}, {args.tokens} tokens")
    results: dict[str, list[dict]] = {"off": [], "auto": []}
    for r in range(args.rounds):
        for setting in (("off", "auto") if r % 2 == 0 else ("auto", "off")):
            row = measure(args, setting)
            results[setting].append(row)
            print(f"offload {setting:4s}: peak PSS {row['peak_pss'] / 2**30:.2f} GiB, {row['step_s']:.2f} s/step",
                  flush=True)
    pss = {s: statistics.median(r["peak_pss"] for r in rows) for s, rows in results.items()}
    step = {s: statistics.median(r["step_s"] for r in rows) for s, rows in results.items()}
    print(f"schedule-aware memory: PSS ratio {pss['auto'] / pss['off']:.2f}, step ratio {step['auto'] / step['off']:.2f}")


if __name__ == "__main__":
    main()
