"""Critic against group baselines on a sparse multi-turn task, and on the demo.

    python benchmarks/critic_credit.py [--task turns|demo] [--turns 4] [--seeds 10] [--steps 150]
        [--methods group,per_agent,central] [--out FILE.json]
    python benchmarks/critic_credit.py --summarise FILE.json [--window 20]   # the summary of a (partial) --out

`--task turns` (default): `critic_credit_env.TakeTurnsEnv`, two tiny agents taking turns for `--turns` turns
(4, or 8 for a longer horizon) with the whole reward on the last turn. `--task demo`: examples/demo/config.yaml
as it is (two turns, reward on each).
Each (method, seed) runs in a child process of its own (in-process trainers, no Ray), so its peak memory
is its own: `group` is `algorithm.baseline: group`; `per_agent` and `central` are `algorithm.baseline:
critic` with that `critic.kind` (a `builtin:tiny` value model in the same process). Printed per run: the
mean training reward of the last `--window` steps, the seconds the run took, the seconds its critics took
(`time/critic`) and the child's peak resident memory; then per method the mean over seeds with a 95%
t-interval, and each critic method's difference from group (paired by seed, 95% t-interval). `--out`
keeps every run's per-step rewards (the curves) and the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

METHODS = ("group", "per_agent", "central")
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def turns_config(steps: int, turns: int = 4) -> dict:
    env = f"{HERE / 'critic_credit_env.py'}"
    agent = {"model": "builtin:tiny", "generation": {"max_completion_length": 2}, "optimizer": {"lr": 1.0e-3},
             "resources": {"num_cpus": 0.5}}
    return {
        "agents": {"alice": agent, "bob": agent},
        "environment": {"name": f"{env}:TakeTurnsEnv", "kwargs": {"turns": turns}},
        "roles": {"assignment": {"a": "alice", "b": "bob"}},
        "data": {"factory": f"{env}:make_dataset", "kwargs": {"turns": turns}},
        "algorithm": {"discount": 1.0, "baseline": "group", "beta": 0.05},
        "train": {"steps": steps, "batch_size": 4, "num_generations": 4, "seed": 0, "progress": False},
        "ray": {"enabled": False},
    }


def demo_config(steps: int) -> dict:
    import yaml

    from protocols.config import load_config

    raw = yaml.safe_load((ROOT / "examples" / "demo" / "config.yaml").read_text())
    config = load_config(ROOT / "examples" / "demo" / "config.yaml")  # paths made absolute
    raw["environment"]["name"], raw["data"] = config.environment.name, config.data.model_dump(exclude_unset=True)
    raw.pop("eval", None)
    raw["train"].update({"steps": steps, "progress": False, "checkpoint_every": 0})
    raw["ray"] = {"enabled": False}
    return raw


def one_run(task: str, method: str, seed: int, steps: int, turns: int = 4) -> dict:
    """Run one (method, seed) here; its per-step rewards, seconds and the critic's seconds."""
    import torch

    from orchestrator.coordinator import Coordinator
    from protocols.config import validate_config

    torch.set_num_threads(1)
    raw = turns_config(steps, turns) if task == "turns" else demo_config(steps)
    raw["train"]["seed"] = seed
    if method != "group":
        raw["algorithm"]["baseline"] = "critic"
        raw["critic"] = {"kind": method, "model": "builtin:tiny", "num_iterations": 1, "optimizer": {"lr": 1.0e-3}}
    began = time.perf_counter()
    config = validate_config(raw, source=ROOT / "run.yaml")
    with tempfile.TemporaryDirectory() as tmp, Coordinator(config, tmp) as coord:
        history = coord.run()
    return {"task": task, "method": method, "seed": seed, "seconds": time.perf_counter() - began,
            "critic_seconds": sum(m.get("time/critic", 0.0) for m in history),
            "rewards": [m["reward/mean"] for m in history],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, T95.get(len(values) - 1, 2.0) * statistics.stdev(values) / len(values) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("turns", "demo"), default="turns")
    parser.add_argument("--turns", type=int, default=4, help="turns of an episode of --task turns")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--summarise", default=None, metavar="FILE.json")
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.task, args.one[0], int(args.one[1]), args.steps, args.turns)))
        return
    if args.summarise:
        runs = json.loads(Path(args.summarise).read_text())["runs"]
        methods = list(dict.fromkeys(r["method"] for r in runs))
        for r in runs:
            r["final"] = statistics.fmean(r["rewards"][-args.window:])
        summarise(runs, methods, curves=True)
        return
    methods = args.methods.split(",")
    runs = []
    for seed in range(args.seeds):  # seeds outermost: an interrupted run still has every method on its seeds
        for method in methods:
            out = subprocess.run([sys.executable, __file__, "--task", args.task, "--steps", str(args.steps),
                                  "--turns", str(args.turns), "--one", method, str(seed)],
                                 capture_output=True, text=True, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            run["final"] = statistics.fmean(run["rewards"][-args.window:])
            runs.append(run)
            print(f"{method:9s} seed {seed}: final reward {run['final']:.3f}  {run['seconds']:.0f} s "
                  f"(critic {run['critic_seconds']:.0f} s)  peak RSS {run['peak_rss_mb']:.0f} MB", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps({"runs": runs}, indent=1))
    summary = summarise(runs, methods)
    if args.out:
        Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary, "args": vars(args)}, indent=1))


def summarise(runs: list[dict], methods: list[str], curves: bool = False) -> dict:
    """Per method: the mean final reward over the seeds every method finished, its 95% interval, the mean seconds,
    critic seconds and peak memory of a run, and (critic methods) the paired difference from group."""
    summary = {}
    done = sorted(s for s in {r["seed"] for r in runs} if all(any(r["seed"] == s and r["method"] == m for r in runs)
                                                                for m in methods))
    runs = [r for r in runs if r["seed"] in done]
    for method in methods:
        mine = {r["seed"]: r for r in runs if r["method"] == method}
        mean, half = interval([mine[s]["final"] for s in done])
        summary[method] = {"final": mean, "ci95": half,
                           "seconds": statistics.fmean(r["seconds"] for r in mine.values()),
                           "critic_seconds": statistics.fmean(r["critic_seconds"] for r in mine.values()),
                           "peak_rss_mb": statistics.fmean(r["peak_rss_mb"] for r in mine.values())}
        mine_s = summary[method]
        line = (f"{method:9s} final reward {mean:.3f} +- {half:.3f} over {len(done)} seeds; {mine_s['seconds']:.0f} s "
                f"a run (critic {mine_s['critic_seconds']:.0f} s), peak RSS {mine_s['peak_rss_mb']:.0f} MB")
        if method != "group" and "group" in methods:
            base = {r["seed"]: r for r in runs if r["method"] == "group"}
            diff, dhalf = interval([mine[s]["final"] - base[s]["final"] for s in done])
            summary[method]["minus_group"], summary[method]["minus_group_ci95"] = diff, dhalf
            line += f"; minus group {diff:+.3f} +- {dhalf:.3f} (paired)"
        print(line)
    if curves:
        steps = len(runs[0]["rewards"])
        edges = [round(steps * k / 10) for k in range(11)]
        print("mean reward per tenth of the run: " + ", ".join(f"{a + 1}-{b}" for a, b in zip(edges, edges[1:])))
        for method in methods:
            mine = [r["rewards"] for r in runs if r["method"] == method]
            tenths = [statistics.fmean(x for rw in mine for x in rw[a:b]) for a, b in zip(edges, edges[1:])]
            print(f"{method:9s} " + " ".join(f"{t:.3f}" for t in tenths))
    return summary


if __name__ == "__main__":
    main()
