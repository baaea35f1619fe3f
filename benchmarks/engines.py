"""HF vs vLLM rollout engines, side by side in one run, on SmolLM2-135M-Instruct.

    python benchmarks/engines.py [--dtypes float32,bfloat16] [--repeats 3] [--threads 1] [--steps 3]
                                 [--skip-generate] [--skip-steps]

1. Generate: 16 prompts x 128 new tokens (stopping disabled, so every row has 128 tokens) through one
   AgentTrainer per (engine, dtype) in this process, `--threads` torch threads; contenders alternate
   within each repeat (who goes first rotates) and each figure is a median over repeats. Also the
   engine's start-up time and the vLLM engine's behaviour log-prob gap to the learner on those tokens.
2. Steps: a generation-heavy two-agent config (two SmolLM2 agents in Ray actors with 1 CPU each, 2 x 4
   episodes of up to 128 tokens per agent and step, both agents train every step), run with each engine
   in turn: whole seconds per step (median over `--steps` after one warm-up step), its generate / update /
   sync parts, the time to start the trainers, and each actor's resident memory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_common as bc  # noqa: E402

MODEL = "builtin:smollm2-135m-instruct"
PROMPTS = [f"Write a long story about a {thing}." for thing in (
    "lighthouse", "violin", "glacier", "robot", "market", "dragon", "river", "train",
    "garden", "comet", "library", "fox", "storm", "bakery", "castle", "desert")]


def generate_times(args) -> None:
    import torch

    from agent_trainer.trainer import AgentTrainer
    from protocols.config import AgentConfig, AlgorithmConfig
    from protocols.messages import Experience

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    import vllm  # noqa: F401  (once per process: counted apart from the engines' start)

    import_s = time.perf_counter() - start
    contenders = [(engine, dtype) for dtype in args.dtypes for engine in ("hf", "vllm")]
    trainers, start_s = {}, {}
    for engine, dtype in contenders:
        rollout = {"engine": engine}
        if engine == "vllm":
            rollout["vllm"] = {"kv_cache_gb": 1.0, "max_num_seqs": 16}
        agent = AgentConfig(model=MODEL, dtype=dtype, generation={"max_completion_length": args.tokens},
                            rollout=rollout)
        start = time.perf_counter()
        trainers[engine, dtype] = AgentTrainer(f"{engine}-{dtype}", agent, AlgorithmConfig(), seed=0)
        start_s[engine, dtype] = time.perf_counter() - start
        trainers[engine, dtype].engine.stop_ids = []  # no stopping: every completion is args.tokens long
    prompt_ids = [trainers[contenders[0]].encode_prompt(p)[0] for p in PROMPTS[:args.prompts]]
    for key, trainer in trainers.items():  # warm-up, untimed
        trainer.engine.generate(prompt_ids, max_new_tokens=8, temperature=1.0, seed=0)
    print(f"vLLM import: {import_s:.1f} s; start-up of each trainer (model load, + engine for vllm): "
          + ", ".join(f"{e} {d} {s:.1f} s" for (e, d), s in start_s.items()), flush=True)

    times = {key: [] for key in contenders}
    gaps = {}
    for r in range(args.repeats):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for key in order:
            start = time.perf_counter()
            rollouts = trainers[key].engine.generate(prompt_ids, max_new_tokens=args.tokens, temperature=1.0,
                                                     seed=r + 1)
            times[key].append(time.perf_counter() - start)
            assert all(len(x.completion_ids) == args.tokens for x in rollouts)
            if key[0] == "vllm" and r == 0:  # behaviour log-probs vs the learner's, on the same tokens
                exps = [Experience(prompt_ids=p, completion_ids=x.completion_ids, advantage=0.0,
                                   old_per_token_logps=x.per_token_logps) for p, x in zip(prompt_ids, rollouts)]
                learner = trainers[key].per_token_logps(exps)
                diffs = [abs(a - b) for e, row in zip(exps, learner) for a, b in zip(e.old_per_token_logps, row)]
                gaps[key] = (statistics.fmean(diffs), max(diffs))
        print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(f"{e} {d} {times[e, d][-1]:.1f} s" for e, d in order),
              flush=True)

    base = bc.median(times["hf", "float32"]) if ("hf", "float32") in times else None
    tokens = args.prompts * args.tokens
    print(f"\ngenerate {args.prompts} prompts x {args.tokens} new tokens, {args.threads} torch thread(s), "
          f"median of {args.repeats}:")
    print(f"{'engine':6s} {'dtype':9s} {'seconds':>8s} {'tokens/s':>9s} {'hf fp32 / this':>14s} {'start s':>8s} "
          f"{'logp gap mean / max':>20s}")
    for key in contenders:
        seconds = bc.median(times[key])
        ratio = f"{base / seconds:14.2f}" if base else f"{'-':>14s}"
        gap = f"{gaps[key][0]:.1e} / {gaps[key][1]:.1e}" if key in gaps else "-"
        print(f"{key[0]:6s} {key[1]:9s} {seconds:8.2f} {tokens / seconds:9.1f} {ratio} {start_s[key]:8.1f} {gap:>20s}")
    for key, trainer in trainers.items():
        if key[0] == "vllm":
            print(f"vllm {key[1]}: engine start-up {start_s[key] - start_s['hf', key[1]]:.1f} s "
                  f"(vllm trainer - hf trainer start-up)")
        trainer.close()


def step_times(args) -> None:
    import ray

    from orchestrator.coordinator import Coordinator

    results = {}
    try:
        for engine in ("hf", "vllm"):
            config = bc.marsi_config(num_agents=2, model=MODEL, batch_size=2, group=4, tokens=args.tokens,
                                     lr=1e-6, steps=args.steps + 1, ray=True, num_cpus=1.0, dataset_size=64,
                                     engine=engine, story=True, vllm={"kv_cache_gb": 0.5, "max_num_seqs": 16})
            start = time.perf_counter()
            with Coordinator(config) as coord:
                start_s = time.perf_counter() - start
                coord.run(until=1)  # warm-up, untimed
                history = coord.run()
                memory = [bc.rss_mb(i["pid"]) for i in coord.pool.info().values()]
            results[engine] = (start_s, history, memory)
            print(f"{engine}: {len(history)} steps done", flush=True)
    finally:
        ray.shutdown()

    def med(history, key):
        return bc.median([m[key] for m in history if key in m])

    print(f"\ntwo SmolLM2 agents, 1 CPU each, 2 x 4 episodes of up to {args.tokens} tokens per agent and step, "
          f"median of {args.steps} steps:")
    print(f"{'engine':6s} {'s/step':>7s} {'generate':>8s} {'update':>7s} {'sync':>6s} {'tokens/agent':>12s} "
          f"{'start s':>8s} {'RSS per actor MB now / peak':>30s}")
    base = med(results["hf"][1], "time/step")
    for engine, (start_s, history, memory) in results.items():
        sync = bc.median([statistics.fmean(v for k, v in m.items() if k.startswith("time/sync/")) for m in history])
        tokens = bc.median([statistics.fmean(m[f"tokens/{a}"] for a in ("a0", "a1")) for m in history])
        rss = ", ".join(f"{now:.0f} / {peak:.0f}" for now, peak in memory)
        print(f"{engine:6s} {med(history, 'time/step'):7.2f} {med(history, 'time/generate'):8.2f} "
              f"{med(history, 'time/update'):7.2f} {sync:6.3f} {tokens:12.0f} {start_s:8.1f} {rss:>30s}")
    print(f"hf / vllm seconds per step: {base / med(results['vllm'][1], 'time/step'):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16", type=lambda s: s.split(","))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"before: {bc.load_line()}\n{bc.machine_line()}", flush=True)
    if not args.skip_generate:
        generate_times(args)
    if not args.skip_steps:
        step_times(args)
    print(f"after: {bc.load_line()}")


if __name__ == "__main__":
    main()
