"""`dtype: auto` against float32 and bfloat16: one step (generate + update) of each, side by side, per model.

    python benchmarks/precision_auto.py [--batch 8] [--tokens 16] [--repeats 3] [--threads 1]

Models: builtin:tiny, a tiny local Llama (d=64, 2 layers: the kind of model bf16 cannot speed up) and
SmolLM2-135M-Instruct. For each, a fresh trainer per dtype; the three are timed in turn, in an order reversed every round, `--repeats`
rounds, so a change in the machine's load hits all of them alike and none always runs after another; the median step is printed, and auto's step over the faster
of float32 and bfloat16. Where this CPU only emulates bf16 (no avx512_bf16 / amx_bf16), a SmolLM2 bf16 step takes
minutes: it is timed with `--emulated` only; otherwise its row gives the matmul probe's bf16 slowdown instead.
The last line: `auto / fastest: worst R` over the models timed in all three.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from agent_trainer import precision  # noqa: E402
from agent_trainer.trainer import AgentTrainer  # noqa: E402
from protocols.config import AgentConfig, AlgorithmConfig  # noqa: E402
from protocols.messages import Experience, GenerateRequest, UpdateRequest  # noqa: E402

DTYPES = ("float32", "bfloat16", "auto")


def tiny_local(out: Path) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from agent_trainer.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def step(trainer: AgentTrainer, prompts: list[str], tokens: int, seed: int) -> float:
    start = time.perf_counter()
    result = trainer.generate(GenerateRequest(prompts=prompts, seed=seed, max_completion_length=tokens))
    exps = [Experience.from_completion(c, (-1.0) ** i) for i, c in enumerate(result.completions)]
    trainer.update(UpdateRequest(experiences=exps))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--emulated", action="store_true", help="time SmolLM2 in bf16 where bf16 is emulated")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    caps = precision.capabilities("cpu")
    native = precision.native_bf16(caps) is not None
    print(f"machine: {precision.describe(caps)}, {os.cpu_count()} CPUs; {args.threads} torch thread(s); batch "
          f"{args.batch} x {args.tokens} new tokens; median of {args.repeats}; load {os.getloadavg()[0]:.2f}")
    prompts = [f"Write a short sentence about the number {i}." for i in range(args.batch)]
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="marsi-precision-") as tmp:
        models = {"builtin:tiny": "builtin:tiny", "tiny local (d=64)": tiny_local(Path(tmp) / "tiny-local"),
                  "SmolLM2-135M": "builtin:smollm2-135m-instruct"}
        print(f"{'model':20s} {'float32 s':>10s} {'bfloat16 s':>11s} {'auto s':>8s}  auto chose")
        for label, model in models.items():
            dtypes = DTYPES if native or args.emulated or label != "SmolLM2-135M" else ("float32", "auto")
            trainers = {d: AgentTrainer(f"bench-{d}", AgentConfig(model=model, dtype=d, micro_batch_size=args.batch,
                                                                  optimizer={"lr": 1e-6}), AlgorithmConfig(), seed=0)
                        for d in dtypes}
            times: dict[str, list[float]] = {d: [] for d in dtypes}
            for r in range(args.repeats + 1):  # the first round warms up
                order = list(trainers) if r % 2 else list(reversed(trainers))  # no dtype always after another
                for d in order:
                    seconds = step(trainers[d], prompts, args.tokens, seed=r)
                    if r:
                        times[d].append(seconds)
            median = {d: statistics.median(v) for d, v in times.items()}
            chosen = trainers["auto"].precision
            bf16 = (f"{median['bfloat16']:11.3f}" if "bfloat16" in median else
                    f"{'x' + format(precision.bf16_slowdown(torch.device('cpu')), '.0f') + ' probe':>11s}")
            print(f"{label:20s} {median['float32']:10.3f} {bf16} {median['auto']:8.3f}  {chosen.dtype} ({chosen.reason})")
            if "bfloat16" in median:
                worst = max(worst, median["auto"] / min(median["float32"], median["bfloat16"]))
            for t in trainers.values():
                t.close()
    print(f"auto / fastest: worst {worst:.2f}")


if __name__ == "__main__":
    main()
