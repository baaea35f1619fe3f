"""Learning with adapter agents against full fine-tuning, from the same seed, one run after the other.

- `demo`: examples/demo (relay, builtin:tiny), 300 steps, alternating; full fine-tuning as config.yaml has it
  (lr 1e-3), adapters as adapters.yaml has it (one shared host; rank 8 on every linear layer and the output
  head, lr 1e-2), and adapters on the linear layers only (peft's `all-linear`, lr 1e-2).
- `smollm2`: the benchmarks' team task (bench_common: two agents told a letter, reward the fraction that
  answer with it) on SmolLM2-135M-Instruct, both agents training every step; full fine-tuning (lr 1e-5)
  against two adapter agents on one shared host (rank 16 on every linear layer, lr 1e-4).

Prints, per contender, the mean reward per block of steps and the last block's mean; runs in-process
(`ray.enabled: false`: the same numbers as with Ray for the same seed).

    python benchmarks/adapters_learning.py [--tasks demo,smollm2] [--smollm2-steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def demo_configs() -> dict:
    from protocols.config import load_config

    demo = ROOT / "examples" / "demo"
    off = ["eval.every=0", "train.progress=false", "ray.enabled=false", "train.checkpoint_every=0"]
    linear = [f"agents.{a}.adapter.target_modules=all-linear" for a in ("alice", "bob")]
    return {
        "full fine-tuning (config.yaml)": load_config(demo / "config.yaml", off),
        "adapters, linear + head (adapters.yaml)": load_config(demo / "adapters.yaml", off),
        "adapters, linear only": load_config(demo / "adapters.yaml", off + linear),
    }


def smollm2_configs(steps: int) -> dict:
    import bench_common as bc

    full = bc.marsi_config(num_agents=2, model="builtin:smollm2-135m-instruct", batch_size=4, group=4, tokens=4,
                           lr=1e-5, steps=steps, ray=False)
    raw = full.model_dump(mode="json")
    raw["hosts"] = {"shared": {"resources": {"num_cpus": 1.0}}}
    for agent in raw["agents"].values():
        del agent["resources"]
        agent.update(host="shared", adapter={"rank": 16, "alpha": 32}, optimizer={**agent["optimizer"], "lr": 1e-4})
    from protocols.config import validate_config

    return {"full fine-tuning (lr 1e-5)": full,
            "adapters r16 on one host (lr 1e-4)": validate_config(raw, source="<benchmark>")}


def train(config) -> tuple[list[float], float]:
    from orchestrator.coordinator import Coordinator

    start = time.perf_counter()
    with Coordinator(config) as coord:
        history = coord.run()
    return [m["reward/mean"] for m in history], time.perf_counter() - start


def main() -> None:
    import bench_common as bc

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="demo,smollm2")
    parser.add_argument("--smollm2-steps", type=int, default=30)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print("$ python " + " ".join([f"benchmarks/{Path(__file__).name}", *sys.argv[1:]]))
    print(f"before: {bc.load_line()}")
    print(bc.machine_line())
    for task in args.tasks.split(","):
        contenders = demo_configs() if task == "demo" else smollm2_configs(args.smollm2_steps)
        for label, config in contenders.items():
            rewards, seconds = train(config)
            block = max(1, len(rewards) // 10)
            blocks = [statistics.fmean(rewards[i:i + block]) for i in range(0, len(rewards), block)]
            print(f"{task} | {label} | mean reward per {block} steps: {', '.join(f'{b:.3f}' for b in blocks)} | "
                  f"last {block}: {blocks[-1]:.3f} | {seconds:.0f} s", flush=True)
    print(f"after: {bc.load_line()}")


if __name__ == "__main__":
    main()
