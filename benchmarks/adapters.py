"""Memory and speed of one host with 1, 2 and 4 adapter agents on one shared base, side by side with the same
numbers of full-model agents, on SmolLM2-135M-Instruct.

Each configuration runs in a fresh subprocess that starts the agents exactly as `marsi run` with
`ray.enabled: false` does (`LocalTrainers`: its hosts, in this process), then plays `--steps` steps of one
generate and one update per agent (batch `--batch` prompts x `--tokens` new tokens, advantages +1/-1, so
every optimizer has its state). Figures:

- `rss MB`: resident memory after the last step (VmRSS), `peak MB`: its high-water mark (VmHWM), of the one
  process. The full-model agents share that one process here too (in a run each has a host, a process, of
  its own, which adds one Python + torch runtime per agent): their figure is a lower bound of theirs.
- `s/step`: median over the steps after the first of the time to generate and update every agent once.
- `x one full`: the memory against one full-model agent's.

    python benchmarks/adapters.py [--counts 1,2,4] [--steps 3] [--batch 4] [--tokens 8] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_common as bc  # this script's folder is first on sys.path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
MODEL = "builtin:smollm2-135m-instruct"


def run_config(kind: str, count: int, rank: int, tokens: int):
    from protocols.config import validate_config

    names = [f"agent{i}" for i in range(count)]
    agents = {}
    for name in names:
        agent = {"model": MODEL, "dtype": "float32", "optimizer": {"lr": 1e-5},
                 "generation": {"max_completion_length": tokens, "use_chat_template": False}}
        if kind == "adapter":
            agent.update(adapter={"rank": rank, "alpha": 2 * rank}, host="shared")
        agents[name] = agent
    raw = {
        "agents": agents,
        "hosts": {"shared": {"resources": {"num_cpus": 1}}} if kind == "adapter" else {},
        "environment": {"name": f"{ROOT / 'tests' / 'envs.py'}:LetterEnv", "kwargs": {"roles": names}},
        "roles": {"assignment": {n: n for n in names}},
        "data": {"factory": f"{ROOT / 'tests' / 'envs.py'}:letters"},
        "ray": {"enabled": False},
    }
    return validate_config(raw, source="<benchmark>")


def child(kind: str, count: int, steps: int, batch: int, tokens: int, rank: int) -> dict:
    """One configuration in this (fresh) process: start its agents, play the steps, measure."""
    import torch

    from agent_trainer.agent import Agent
    from agent_trainer.group import LocalTrainers
    from protocols.messages import Experience, GenerateRequest, UpdateRequest
    from protocols.plan import plan_of

    torch.set_num_threads(1)
    config = run_config(kind, count, rank, tokens)
    start = time.perf_counter()
    trainers = LocalTrainers(config, plan_of(config), {name: steps for name in config.agents})
    load_seconds = time.perf_counter() - start
    prompts = [f"Letter: {'abcd'[i % 4]}\nSay the letter:" for i in range(batch)]
    step_seconds = []
    for step in range(steps):
        start = time.perf_counter()
        generated = trainers.each(Agent.generate, {a: GenerateRequest(prompts=prompts, seed=step)
                                                   for a in config.agents})
        updates = {}
        for agent, result in generated.items():
            exps = [Experience(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, advantage=(-1.0) ** i,
                               old_per_token_logps=c.per_token_logps) for i, c in enumerate(result.completions)]
            updates[agent] = UpdateRequest(experiences=exps)
        trainers.each(Agent.update, updates)
        step_seconds.append(time.perf_counter() - start)
    rss, peak = bc.rss_mb(os.getpid())
    trainable = sum(p.numel() for t in trainers.trainers.values() for g in t.optimizer.param_groups for p in g["params"])
    trainers.close()
    return {"kind": kind, "count": count, "rss": rss, "peak": peak, "load_s": load_seconds,
            "step_s": statistics.median(step_seconds[1:] or step_seconds), "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="1,2,4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(args.child[0], int(args.child[1]), args.steps, args.batch, args.tokens, args.rank)
        print(json.dumps(result))
        return
    print("$ python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]))
    print(f"before: {bc.load_line()}")
    print(bc.machine_line())
    started = time.perf_counter()
    results = []
    for count in [int(c) for c in args.counts.split(",")]:
        for kind in ("adapter", "full"):  # side by side: each count's pair runs back to back
            out = subprocess.run([sys.executable, __file__, "--child", kind, str(count), "--steps", str(args.steps),
                                  "--batch", str(args.batch), "--tokens", str(args.tokens), "--rank", str(args.rank)],
                                 capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
            if out.returncode != 0:
                sys.exit(f"{kind} x {count} failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    one_full = next(r for r in results if r["kind"] == "full" and r["count"] == 1)["rss"]
    print(f"\nSmolLM2-135M-Instruct, float32; adapters rank {args.rank} on every linear layer; {args.steps} steps of "
          f"{args.batch} prompts x {args.tokens} tokens per agent; one torch thread")
    print(f"{'agents':>6s} {'kind':>8s} {'trainable':>11s} {'rss MB':>8s} {'peak MB':>8s} {'x one full':>10s} "
          f"{'s/step':>7s} {'load s':>7s}")
    for r in results:
        print(f"{r['count']:6d} {r['kind']:>8s} {r['trainable']:11,d} {r['rss']:8.0f} {r['peak']:8.0f} "
              f"{r['rss'] / one_full:10.2f} {r['step_s']:7.2f} {r['load_s']:7.1f}")
    print(f"\nafter: {bc.load_line()}; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
