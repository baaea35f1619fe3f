"""Time one AgentTrainer generate and update on a batch, side by side for the built-in models.

    python benchmarks/trainer_speed.py [--batch 8] [--tokens 32] [--repeats 3] [--models builtin:tiny,...]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import bench_common as bc  # noqa: E402  (this script's folder is first on sys.path)
from agent_trainer.trainer import AgentTrainer  # noqa: E402
from protocols.config import AgentConfig, AlgorithmConfig  # noqa: E402
from protocols.messages import Experience, GenerateRequest, UpdateRequest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--models", default="builtin:tiny,builtin:smollm2-135m-instruct")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(bc.machine_line())
    print(f"batch {args.batch} x {args.tokens} new tokens, {args.threads} torch threads, median of {args.repeats}")
    print(f"{'model':34s} {'generate s':>11s} {'update s':>9s} {'tokens':>7s} {'peak RSS GB':>11s}")
    for name in args.models.split(","):
        agent = AgentConfig(model=name, dtype="float32", micro_batch_size=args.batch,
                            generation={"max_completion_length": args.tokens}, optimizer={"lr": 1e-6})
        trainer = AgentTrainer("bench", agent, AlgorithmConfig(), seed=0)
        prompts = [f"Write a short sentence about the number {i}." for i in range(args.batch)]
        gen_s, upd_s, tokens = [], [], 0
        for r in range(args.repeats):
            start = time.perf_counter()
            result = trainer.generate(GenerateRequest(prompts=prompts, seed=r, max_completion_length=args.tokens))
            gen_s.append(time.perf_counter() - start)
            exps = [Experience(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, advantage=(-1.0) ** i)
                    for i, c in enumerate(result.completions)]
            tokens = sum(len(e.completion_ids) for e in exps)
            start = time.perf_counter()
            trainer.update(UpdateRequest(experiences=exps))
            upd_s.append(time.perf_counter() - start)
        rss = _peak_rss_gb()
        print(f"{name:34s} {statistics.median(gen_s):11.2f} {statistics.median(upd_s):9.2f} {tokens:7d} {rss:11.2f}")


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


if __name__ == "__main__":
    main()
