"""The default demo over seeds: its training reward and its held-out gain, per seed and summarised.

    python benchmarks/demo_seeds.py [--seeds 10] [--threads 1] [--setting both] [--config examples/demo/config.yaml]
        [KEY=VALUE ...]

Each seed runs the demo config with `train.seed=SEED` in this process (no Ray: the same maths and, on one
machine, the same metrics step for step as with Ray), then evaluates the held-out set at the initial and
the final weights, on the same episodes and seeds, and compares them as `marsi eval --compare initial last`
does (a paired 95% interval over the held-out samples). `--setting` asks the question "does training them
together help?" at the same number of steps:

- `both`: the demo as it is, alice and bob each trained (in alternation);
- `first_only`: the config's first agent (alice) trained every step, the second frozen at its initial weights;
- `one_agent`: the first agent holds every role and trains every step.

With `eval.partners` in the config, each partner setting's held-out reward at the final weights is
compared with the initial evaluation too (`bob_initial`: alice as trained beside bob at his initial
weights): what each agent's training buys on its own.

Printed per seed: the team reward of the first and last 30 steps, the held-out reward at the initial and
final weights with the gain's interval, each agent's share of groups whose returns were all equal over the
last 30 steps (`groups/zero_variance/AGENT`: no gradient; near 1 with a reward short of 1.0 is a stall),
and the seconds taken. The summary gives the median and the worst
seed of the last-30-step training reward and of the held-out gain, and on how many seeds the gain's
interval excludes 0. `--threads` sets torch's intra-op threads: run it at 1 and 2 to see how far the
figures move with the thread count (float rounding differs, so individual seeds' trajectories do).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import yaml  # noqa: E402

import bench_common as bc  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402
from orchestrator.evaluation import compare  # noqa: E402
from protocols.config import apply_overrides, validate_config  # noqa: E402

SETTINGS = ("both", "first_only", "one_agent")
WINDOW = 30  # steps averaged at each end of a run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE.parent / "examples" / "demo" / "config.yaml"))
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--setting", choices=SETTINGS, default="both")
    parser.add_argument("--keep", metavar="DIR", help="keep each seed's run directory under DIR (else discarded)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value over the config, e.g. train.steps=200")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    print(f"$ python {' '.join(sys.argv)}\n{bc.machine_line()}; torch threads {args.threads}\nbefore: {bc.load_line()}",
          flush=True)
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        row = run(args, seed)
        rows.append(row)
        gain = row["gain"]
        print(f"seed {seed}: train {row['first']:.3f} -> {row['last']:.3f} | held-out {interval(gain)} | zero-variance groups, last {WINDOW} steps: "
              f"{', '.join(f'{a} {v:.2f}' for a, v in row['flat'].items())} | {row['seconds']:.0f} s", flush=True)
        for label, partner in row["partners"].items():
            print(f"    {label}: held-out {interval(partner)}", flush=True)
    print(f"after: {bc.load_line()}")
    lasts, gains = [r["last"] for r in rows], [r["gain"]["difference"] for r in rows]
    sure = sum(r["gain"]["distinguishable"] and r["gain"]["difference"] > 0 for r in rows)
    print(f"\n{args.setting}, {len(rows)} seeds, {rows[0]['steps']} steps: training reward, last {WINDOW} steps: median "
          f"{statistics.median(lasts):.3f}, worst {min(lasts):.3f}; held-out gain: median {statistics.median(gains):+.3f}, "
          f"worst {min(gains):+.3f}, interval above 0 on {sure} of {len(rows)} seeds; "
          f"{statistics.median(r['seconds'] for r in rows):.0f} s per seed (median)")
    for label in rows[0]["partners"]:
        diffs = [r["partners"][label]["difference"] for r in rows]
        above = sum(r["partners"][label]["distinguishable"] and r["partners"][label]["difference"] > 0 for r in rows)
        print(f"  {label}: held-out gain median {statistics.median(diffs):+.3f}, worst {min(diffs):+.3f}, "
              f"interval above 0 on {above} of {len(rows)} seeds")


def interval(gain: dict) -> str:
    return (f"{gain['before']:.3f} -> {gain['after']:.3f}, gain {gain['difference']:+.3f} "
            f"(95% CI {gain['low']:+.3f} .. {gain['high']:+.3f}{'' if gain['distinguishable'] else ', not distinguishable'})")


def config_for(args, seed: int, run_dir: str):
    raw = yaml.safe_load(Path(args.config).read_text())
    raw = apply_overrides(raw, [*args.overrides, f"train.seed={seed}", "ray.enabled=false", "train.progress=false",
                                f"train.run_dir={run_dir}"])
    first, *others = raw["agents"]
    if args.setting == "first_only":
        raw["schedule"] = {"kind": "simultaneous", "frozen": others}
    elif args.setting == "one_agent":
        for other in others:
            raw["agents"].pop(other)
        raw["roles"]["assignment"] = {role: first for role in raw["roles"]["assignment"]}
        raw["schedule"] = {"kind": "simultaneous"}
    if args.setting != "both" and raw.get("eval"):
        raw["eval"].pop("partners", None)  # the partners name agents this setting freezes or drops
    return validate_config(raw, source=Path(args.config).resolve())


def run(args, seed: int) -> dict:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(args.keep) / f"{args.setting}-seed{seed}" if args.keep else Path(tmp) / "run"
        config = config_for(args, seed, str(run_dir))
        with Coordinator(config, run_dir=run_dir) as coord:
            history = coord.run()  # evaluates before the first step and after the last
            (_, before), (_, after) = coord.eval_results[0], coord.eval_results[-1]
    rewards = [m["reward/mean"] for m in history]
    gains = {label: compare(before.episodes[label]["reward/mean"], after.episodes[label]["reward/mean"], before.samples)
             for label in after.episodes}  # each setting against itself at the initial weights: the same seeds
    flat = {key.rsplit("/", 1)[1]: statistics.fmean(m[key] for m in history[-WINDOW:] if key in m)
            for key in sorted({k for m in history for k in m if k.startswith("groups/zero_variance/")})}
    return {"first": statistics.fmean(rewards[:WINDOW]), "last": statistics.fmean(rewards[-WINDOW:]), "gain": gains[""],
            "partners": {label: gain for label, gain in gains.items() if label},
            "flat": flat, "steps": len(rewards), "seconds": time.perf_counter() - start}


if __name__ == "__main__":
    main()
