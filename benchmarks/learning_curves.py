"""Learning curves of marsi's two-agent benchmark task over seeds, for two settings side by side.

    python benchmarks/learning_curves.py [--model builtin:tiny] [--steps 60] [--seeds 10] [--batch 8] [--group 4]
        [--tokens 8] [--lr 3e-3] [--compare dtype=float32,bfloat16]

The task and settings are `bench_common`'s (the ones `whole_run.py` and `vs_comlrl.py` time). Each seed
runs once per setting, in this process (no Ray: the maths is the same, and the runs stay short),
the settings alternating. `--compare KEY=A,B` names what differs: `dtype` (the agents' compute dtype:
float32, or bfloat16 over float32 master weights) or `top_k`. Printed per setting: the team
reward averaged over seeds in each tenth of the run, with the standard error over seeds, and the
mean over the last tenth; the last line is the difference of the last-tenth means and its standard
error, so "unchanged" reads as a difference within about two standard errors.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import bench_common as bc  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="samples per step")
    parser.add_argument("--group", type=int, default=4, help="completions per sample")
    parser.add_argument("--tokens", type=int, default=8, help="max new tokens")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--compare", default="dtype=float32,bfloat16", help="KEY=A,B with KEY dtype or top_k")
    args = parser.parse_args()
    key, _, values = args.compare.partition("=")
    if key not in ("dtype", "top_k") or len(values.split(",")) != 2:
        parser.error("--compare takes KEY=A,B with KEY dtype or top_k, e.g. dtype=float32,bfloat16")
    settings = values.split(",")

    import torch

    torch.set_num_threads(1)
    print(f"$ python {' '.join(sys.argv)}\nbefore: {bc.load_line()}", flush=True)
    print(bc.machine_line())
    curves: dict[str, list[list[float]]] = {s: [] for s in settings}
    start = time.perf_counter()
    for seed in range(args.seeds):
        for setting in settings if seed % 2 == 0 else settings[::-1]:
            curves[setting].append(run(args, key, setting, seed))
    print(f"after: {bc.load_line()}; {time.perf_counter() - start:.0f} s\n")

    tenth = max(1, args.steps // 10)
    print(f"{args.model}, 2 agents, {args.steps} steps of {args.batch} samples x {args.group}, {args.tokens} new tokens, "
          f"lr {args.lr}, {args.seeds} seeds; team reward per tenth of the run, mean over seeds (standard error)")
    lasts = {}
    for setting, runs in curves.items():
        blocks = [[statistics.fmean(c[i:i + tenth]) for c in runs] for i in range(0, args.steps, tenth)]
        cells = " ".join(f"{statistics.fmean(b):.2f}({sem(b):.2f})" for b in blocks)
        lasts[setting] = blocks[-1]
        print(f"  {key}={setting:9s} {cells}")
    a, b = (lasts[s] for s in settings)
    difference = statistics.fmean(b) - statistics.fmean(a)
    error = math.sqrt(sem(a) ** 2 + sem(b) ** 2)
    print(f"last tenth: {key}={settings[1]} minus {key}={settings[0]}: {difference:+.3f} (standard error {error:.3f})")


def run(args, key: str, setting: str, seed: int) -> list[float]:
    """Mean team reward of each step of one in-process run."""
    overrides = {"dtype": setting} if key == "dtype" else {}
    with tempfile.TemporaryDirectory() as tmp:
        config = bc.marsi_config(model=args.model, batch_size=args.batch, group=args.group, tokens=args.tokens,
                                 lr=args.lr, steps=args.steps, seed=seed, ray=False, run_dir=tmp, **overrides)
        if key == "top_k":
            for agent in config.agents.values():
                agent.generation.top_k = int(setting)
        with Coordinator(config, run_dir=Path(tmp) / "run") as coord:
            return [m["reward/mean"] for m in coord.run()]


def sem(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


if __name__ == "__main__":
    main()
