"""HF vs vLLM rollout engines, side by side in one run, on SmolLM2-135M-Instruct.

    python benchmarks/engines.py [--dtypes float32,bfloat16] [--repeats 3] [--threads 1] [--steps 3]
                                 [--step-tokens 32,128] [--skip-generate] [--skip-sync]
                                 [--skip-learner] [--skip-steps]

1. Generate: 16 prompts x 128 new tokens (stopping disabled, so every row has 128 tokens) through one
   AgentTrainer per (engine, dtype) in this process, `--threads` torch threads; contenders alternate
   within each repeat (who goes first rotates) and each figure is a median over repeats. Also the
   engine's start-up time and the vLLM engine's behaviour log-prob gap to the learner on those tokens.
2. Steps: a generation-heavy two-agent config (two SmolLM2 agents in Ray actors with 1 CPU each, 2 x 4
   episodes per agent and step, both agents train every step), per dtype and per `--step-tokens` new tokens,
   run with each engine in turn (who goes first alternates): whole seconds per step (median over `--steps`
   after one warm-up step), its generate / update parts, the learner's own share of the update (`learn`) and the
   engine's weight sync, the time to start the trainers, and each trainer actor's memory (PSS of its process
   tree, and peak RSS). The vLLM engine's KV cache is sized to the run (`RunPlan.engine_cache_sizes`).
Between the two (`sync_times`): per dtype, one vLLM agent in this process times its weight sync, vLLM's generic
reload and a plain `copy_` of the same weights, alternating, and an adapter agent (rank 16) its adapter's sync; then (`learner_times`) the learner's update with
and without a vLLM engine resident in its process, wall and CPU seconds, each in a fresh process, alternating.
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


def sync_times(args) -> None:
    """Per dtype, in this process, alternating, median of `--repeats` (at least 3): the vLLM engine's weight sync
    (the in-place copy of agent_trainer/vllm_weights.py), vLLM's generic in-place reload (what the engine falls
    back to), and a plain `copy_` of the same weights into preallocated tensors: what no sync can beat."""
    import torch

    from agent_trainer.trainer import AgentTrainer
    from protocols.config import AgentConfig, AlgorithmConfig

    torch.set_num_threads(args.threads)
    print(f"\nweight sync of one SmolLM2 agent, {args.threads} torch thread(s), median of {max(3, args.repeats)}:")
    print(f"{'dtype':9s} {'plain copy s':>12s} {'in-place sync s':>15s} {'vLLM reload s':>13s} {'sync / copy':>11s}")
    for dtype in args.dtypes:
        agent = AgentConfig(model=MODEL, dtype=dtype, generation={"max_completion_length": 32},
                            rollout={"engine": "vllm", "vllm": {"kv_cache_gb": 0.125, "max_num_seqs": 8}})
        trainer = AgentTrainer(f"sync-{dtype}", agent, AlgorithmConfig(), seed=0)
        engine, weights = trainer.engine, list(trainer.model.state_dict().values())
        buffers = [w.clone() for w in weights]
        engine.sync(trainer.model)  # builds the engine's sync plan (once per engine), untimed
        plan = engine._plan

        def copy() -> None:
            with torch.no_grad():
                for b, w in zip(buffers, weights):
                    b.copy_(w)

        def reload() -> None:
            engine._plan = False
            try:
                engine.sync(trainer.model)
            finally:
                engine._plan = plan

        times = {"copy": [], "sync": [], "reload": []}
        contenders = {"copy": copy, "sync": lambda: engine.sync(trainer.model), "reload": reload}
        for r in range(max(3, args.repeats)):
            for name in list(contenders)[r % 3:] + list(contenders)[:r % 3]:
                start = time.perf_counter()
                contenders[name]()
                times[name].append(time.perf_counter() - start)
        copy_s, sync_s, reload_s = (bc.median(times[k]) for k in ("copy", "sync", "reload"))
        print(f"{dtype:9s} {copy_s:12.3f} {sync_s:15.3f} {reload_s:13.3f} {sync_s / copy_s:11.1f}", flush=True)
        trainer.close()
        adapter_sync_times(args, dtype)


def adapter_sync_times(args, dtype: str) -> None:
    """An adapter agent (LoRA of rank 16 on every linear layer) sampling with vLLM: its sync writes the adapter
    and loads it into the engine's slot (agent_trainer/engine_vllm_adapters.py), against a plain `copy_` of the
    adapter's tensors; alternating, median of `--repeats` (at least 3)."""
    import torch

    from agent_trainer.adapters import AdapterTrainer
    from protocols.config import AgentConfig, AlgorithmConfig

    agent = AgentConfig(model=MODEL, dtype=dtype, generation={"max_completion_length": 32},
                        rollout={"engine": "vllm", "vllm": {"kv_cache_gb": 0.125, "max_num_seqs": 8}},
                        adapter={"rank": 16, "alpha": 32, "target_modules": "all-linear"})
    trainer = AdapterTrainer(f"lora-{dtype}", agent, AlgorithmConfig(), seed=0)
    weights = list(trainer.published_weights().values())
    buffers = [w.clone() for w in weights]

    def copy() -> None:
        with torch.no_grad():
            for b, w in zip(buffers, weights):
                b.copy_(w)

    times = {"copy": [], "sync": []}
    contenders = {"copy": copy, "sync": lambda: trainer.engine.sync(trainer.model)}
    for r in range(max(3, args.repeats)):
        for name in list(contenders)[r % 2:] + list(contenders)[:r % 2]:
            start = time.perf_counter()
            contenders[name]()
            times[name].append(time.perf_counter() - start)
    copy_s, sync_s = bc.median(times["copy"]), bc.median(times["sync"])
    megabytes = sum(w.numel() * w.element_size() for w in weights) / 1e6
    print(f"{'  adapter':9s} {copy_s:12.4f} {sync_s:15.4f} {'-':>13s} {sync_s / copy_s:11.1f}   (rank 16, "
          f"{megabytes:.1f} MB, {len(weights)} tensors)", flush=True)
    trainer.close()


def learner_child(engine: str, dtype: str, threads: int) -> None:
    """In a process of its own: one SmolLM2 agent with `engine` generates 8 completions of 32 tokens once, then
    updates on them 3 times; prints each update's wall and CPU seconds without the sync, as JSON."""
    import json

    import psutil
    import torch

    from agent_trainer.trainer import AgentTrainer
    from protocols.config import AgentConfig, AlgorithmConfig
    from protocols.messages import Experience, GenerateRequest, UpdateRequest

    torch.set_num_threads(threads)
    rollout = {"engine": engine, **({"vllm": {"kv_cache_gb": 0.25, "max_num_seqs": 16}} if engine == "vllm" else {})}
    agent = AgentConfig(model=MODEL, dtype=dtype, optimizer={"lr": 1e-7}, generation={"max_completion_length": 32},
                        rollout=rollout)
    trainer = AgentTrainer(engine, agent, AlgorithmConfig(), seed=0)
    trainer.engine.stop_ids = []  # every completion 32 tokens: both engines' learners see the same shapes
    result = trainer.generate(GenerateRequest(prompts=PROMPTS[:8], seed=1))
    experiences = [Experience.from_completion(c, (-1.0) ** i) for i, c in enumerate(result.completions)]
    process, updates = psutil.Process(), []
    for _ in range(3):
        cpu, wall = sum(process.cpu_times()[:2]), time.perf_counter()
        metrics = trainer.update(UpdateRequest(experiences=experiences))
        sync_cpu = metrics.sync_seconds  # the sync is single-threaded work: its wall time stands for its CPU time
        updates.append((time.perf_counter() - wall - metrics.sync_seconds,
                        sum(process.cpu_times()[:2]) - cpu - sync_cpu))
    trainer.close()
    print("LEARNER " + json.dumps(updates), flush=True)


def learner_times(args) -> None:
    """The learner's update (without the sync) with no engine beside it (hf) and with a vLLM engine resident in
    its process, each in a fresh process, alternating, 2 rounds of 3 updates; CPU seconds are what the load of
    other jobs does not move."""
    import json
    import subprocess

    dtype = args.dtypes[0]
    runs = {"hf": [], "vllm": []}
    for r in range(2):
        for engine in (("hf", "vllm") if r % 2 == 0 else ("vllm", "hf")):
            done = subprocess.run([sys.executable, __file__, "--learner-child", engine, "--dtypes", dtype,
                                   "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            line = next(x for x in done.stdout.splitlines() if x.startswith("LEARNER "))
            runs[engine] += json.loads(line.removeprefix("LEARNER "))[1:]  # the first update warms up
    print(f"\nthe learner's update without the sync, 8 x 32 tokens, {dtype}, {args.threads} thread(s), each engine "
          "in a fresh process, alternating, median of 4 updates:")
    for engine, values in runs.items():
        wall, cpu = bc.median([w for w, _ in values]), bc.median([c for _, c in values])
        print(f"{engine:5s} {'(vLLM engine resident)' if engine == 'vllm' else '(no engine)':23s} wall {wall:6.2f} s, "
              f"CPU {cpu:6.2f} s", flush=True)


def pss_tree_mb(pid: int) -> float:
    """Proportional set size of a process and all its children, MB (shared pages split between their users)."""
    import psutil

    process = psutil.Process(pid)
    return sum(p.memory_full_info().pss for p in [process, *process.children(recursive=True)]) / 1e6


def step_times(args) -> None:
    import ray

    from orchestrator.coordinator import Coordinator

    def med(history, key):
        return bc.median([m[key] for m in history if key in m])

    def per_agent(history, kind):  # median over steps of the mean over agents (time/learn/a0, ..., tokens/a0, ...)
        prefix = "tokens/" if kind == "tokens" else f"time/{kind}/"
        return bc.median([statistics.fmean(v for k, v in m.items() if k.startswith(prefix)) for m in history])

    print(f"\ntwo SmolLM2 agents in Ray actors, 1 CPU each, 2 x 4 episodes per agent and step, both agents train "
          f"every step, median of {args.steps} steps after one warm-up step; learn: the learner's share of the "
          "update (no sync) and tokens: the completion tokens it trained on, per agent; memory: PSS of each trainer "
          "actor's process tree (sum over the two) and each one's peak RSS, after the last step", flush=True)
    print(f"{'dtype':9s} {'tokens':>6s} {'engine':6s} {'s/step':>7s} {'vllm/hf':>7s} {'generate':>8s} {'update':>7s} "
          f"{'learn':>6s} {'tokens':>6s} {'sync':>6s} {'start s':>8s} {'PSS MB':>7s} {'vllm/hf':>7s} {'peak RSS MB':>12s}  load",
          flush=True)
    results = {}
    try:
        for dtype in args.dtypes:
            for n, tokens in enumerate(args.step_tokens):
                engines = ("hf", "vllm") if n % 2 == 0 else ("vllm", "hf")  # who goes first alternates
                for engine in engines:
                    config = bc.marsi_config(num_agents=2, model=MODEL, batch_size=2, group=4, tokens=tokens,
                                             lr=1e-6, steps=args.steps + 1, ray=True, num_cpus=1.0, dataset_size=64,
                                             engine=engine, story=True, dtype=dtype, vllm={"max_num_seqs": 16})
                    start = time.perf_counter()
                    with Coordinator(config) as coord:
                        start_s = time.perf_counter() - start
                        coord.run(until=1)  # warm-up, untimed
                        history = coord.run()
                        pids = [i["pid"] for i in coord.pool.info().values()]
                        memory = [(pss_tree_mb(pid), bc.rss_mb(pid)[1]) for pid in pids]
                    results[dtype, tokens, engine] = history
                    step, pss = med(history, "time/step"), sum(p for p, _ in memory)
                    results[dtype, tokens, engine, "step"], results[dtype, tokens, engine, "pss"] = step, pss
                    other = (dtype, tokens, "hf")
                    ratio = lambda key, value: (f"{value / results[(*other, key)]:7.2f}"  # noqa: E731
                                                if (*other, key) in results else f"{'-':>7s}")
                    print(f"{dtype:9s} {tokens:6d} {engine:6s} {step:7.2f} {ratio('step', step)} "
                          f"{med(history, 'time/generate'):8.2f} {med(history, 'time/update'):7.2f} "
                          f"{per_agent(history, 'learn'):6.2f} {per_agent(history, 'tokens'):6.0f} {per_agent(history, 'sync'):6.3f} "
                          f"{start_s:8.1f} "
                          f"{pss:7.0f} {ratio('pss', pss)} {' / '.join(f'{r:.0f}' for _, r in memory):>12s}  "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
    finally:
        ray.shutdown()
    print("\nvllm / hf, same dtype and tokens, measured one right after the other:")
    for dtype in args.dtypes:
        for tokens in args.step_tokens:
            v, h = (dtype, tokens, "vllm"), (dtype, tokens, "hf")
            if (*v, "step") in results and (*h, "step") in results:
                print(f"{dtype:9s} {tokens:4d} tokens: step {results[(*v, 'step')] / results[(*h, 'step')]:.2f}x, "
                      f"memory (PSS) {results[(*v, 'pss')] / results[(*h, 'pss')]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="float32,bfloat16", type=lambda s: s.split(","))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--step-tokens", default="32,128", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--skip-generate", action="store_true")
    parser.add_argument("--skip-steps", action="store_true")
    parser.add_argument("--skip-sync", action="store_true")
    parser.add_argument("--skip-learner", action="store_true")
    parser.add_argument("--learner-child", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.learner_child:
        return learner_child(args.learner_child, args.dtypes[0], args.threads)
    print(f"before: {bc.load_line()}\n{bc.machine_line()}", flush=True)
    if not args.skip_generate:
        generate_times(args)
    if not args.skip_sync:
        sync_times(args)
    if not args.skip_learner:
        learner_times(args)
    if not args.skip_steps:
        step_times(args)
    print(f"after: {bc.load_line()}")


if __name__ == "__main__":
    main()
