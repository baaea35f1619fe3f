"""Resident memory of one AgentTrainer over generate + update rounds, with and without returning freed memory
to the system (`agent_trainer.heap.return_freed_memory`, which every trainer process calls), side by side.

    python benchmarks/trainer_memory.py [--model builtin:smollm2-135m-instruct] [--rounds 3] [--batch 8]
                                        [--tokens 32] [--prompt-tokens 40]

Each setting runs in a fresh process (glibc's allocator settings are per process), one after the other;
printed: RSS after loading, after each round, and the process's peak, in MB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def child(args) -> dict:
    if args.child == "returned":
        from agent_trainer.heap import return_freed_memory

        assert return_freed_memory()
    import torch

    import bench_common as bc
    from agent_trainer.trainer import AgentTrainer
    from protocols.messages import Experience, GenerateRequest, UpdateRequest

    torch.set_num_threads(1)
    config = bc.marsi_config(num_agents=1, model=args.model, tokens=args.tokens, ray=False,
                             micro_batch_size=args.batch, lr=1e-5)
    trainer = AgentTrainer("a0", config.agents["a0"], config.algorithm, seed=0)
    rows = {"loaded": bc.rss_mb(os.getpid())[0]}
    prompts = [bc.role_prompt(0, bc.LETTERS[i % 4], args.prompt_tokens) for i in range(args.batch)]
    for r in range(args.rounds):
        result = trainer.generate(GenerateRequest(prompts=prompts, seed=r))
        advantages = [1.0 if i % 2 else -1.0 for i in range(args.batch)]
        trainer.update(UpdateRequest(experiences=[Experience.from_completion(c, a)
                                                  for c, a in zip(result.completions, advantages)]))
        rows[f"after round {r + 1}"] = bc.rss_mb(os.getpid())[0]
    rows["peak"] = bc.rss_mb(os.getpid())[1]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--child", choices=("kept", "returned"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    import bench_common as bc

    print(f"$ {' '.join([Path(sys.executable).name, *sys.argv])}\nbefore: {bc.load_line()}")
    print(bc.machine_line())
    runs = {}
    for setting in ("kept", "returned"):
        argv = [sys.executable, __file__, "--child", setting, *sys.argv[1:]]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        runs[setting] = json.loads(out.strip().splitlines()[-1])
    print(f"after: {bc.load_line()}\n")
    print(f"{'RSS MB':16s} {'freed memory kept':>18s} {'returned':>10s} {'returned/kept':>14s}")
    for key in runs["kept"]:
        kept, returned = runs["kept"][key], runs["returned"][key]
        print(f"{key:16s} {kept:18.0f} {returned:10.0f} {returned / kept:14.2f}")


if __name__ == "__main__":
    main()
