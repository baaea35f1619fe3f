"""marsi's `hf` decode against the floor this machine allows it, on one thread.

    python benchmarks/decode_floor.py [--model builtin:smollm2-135m-instruct] [--rows 8] [--tokens 32 128]
                                      [--repeats 3]

`HFEngine.generate` samples `--rows` distinct prompts (temperature 1, no top-k / top-p, no stop ids: every row
decodes exactly T tokens) `--repeats` times after one warm-up, each time right after measuring the rates below;
the row printed is the repeat of median marsi / floor, with its own rates. The floor of the same work is what reading
the weights and doing the arithmetic cost at the rates this machine shows at the time:

    floor(T) = prefill + (T - 1) x step
    prefill  = weight bytes / bandwidth + prefill FLOPs / matmul rate at the prefill's rows
    step     = (weight bytes + KV-cache bytes at the step) / bandwidth + step FLOPs / matmul rate at B rows

- weight bytes: every matrix a forward multiplies by (each layer's projections and the output head, tied or
  not); the embedding lookup reads B rows of it, not counted.
- bandwidth: a one-thread `sum` over a 256 MB float32 tensor (read only, as the weights are).
- FLOPs: 2 x rows x weights of each matrix (the output head at one position per row: `logits_to_keep=1`),
  plus attention's 4 x rows x heads x head dim x keys per layer.
- matmul rate: `F.linear` of each of the model's matrix shapes at the step's rows (B) and at the prefill's rows,
  with the weight already in cache (so the rate is the arithmetic's, not memory's): total FLOPs over total time.

The two terms are added, not overlapped: the floor is a time no decode loop of this model on this thread can beat
by more than the overlap of memory and arithmetic. Sampling (softmax, noise, the race) is not in the floor.
The rates are measured right before each timed generate, so a change in the machine's load hits both. The last line:
`decode: marsi / floor R at RxT` for the first `--tokens`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from agent_trainer.engines import HFEngine  # noqa: E402
from agent_trainer.models import load_model  # noqa: E402
from sampling_parts import time_it  # noqa: E402

F = torch.nn.functional


def matrices(model) -> list[torch.Tensor]:
    """Every weight matrix a forward multiplies by: the layers' linear weights and the output head's."""
    head = model.get_output_embeddings().weight
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not head]
    return weights + [head]


def bandwidth() -> float:
    """Bytes per second of a one-thread read (a `sum`) of 256 MB, best of 5."""
    data = torch.ones(1 << 26)
    data.sum()
    return data.numel() * 4 / min(time_it(data.sum) for _ in range(5))


def matmul_rate(shapes: dict[tuple[int, int], int], rows: int) -> float:
    """FLOPs per second of `F.linear` at `rows` rows over the model's (out, in) matrix shapes, each counted as
    often as the model holds it, the weight in cache (the output head by 1024-row slices)."""
    flops = seconds = 0.0
    for (out, inp), count in shapes.items():
        weight, x = torch.randn(min(out, 1024), inp), torch.randn(rows, inp)
        F.linear(x, weight)
        per_slice = statistics.median(time_it(lambda: F.linear(x, weight)) for _ in range(7))
        seconds += per_slice * out / weight.size(0) * count
        flops += 2.0 * rows * out * inp * count
    return flops / seconds


def prompts_of(tok, rows: int) -> list[list[int]]:
    return [tok(f"{bc.preamble(16)}Question {i}: write one short sentence about the number {i}.")["input_ids"]
            for i in range(rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"$ python {' '.join(sys.argv)}\nbefore: {bc.load_line()}", flush=True)
    print(bc.machine_line())
    model, tok = load_model(args.model)
    model.eval()
    config = model.config
    engine = HFEngine(model, top_k=0, top_p=1.0, stop_ids=[], pad_id=tok.pad_token_id, device=torch.device("cpu"),
                      autocast=contextlib.nullcontext)
    prompts = prompts_of(tok, args.rows)
    B, P = len(prompts), max(len(p) for p in prompts)
    weights = matrices(model)
    head = weights[-1]
    shapes: dict[tuple[int, int], int] = {}
    for w in weights:
        shapes[tuple(w.shape)] = shapes.get(tuple(w.shape), 0) + 1
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    layers, heads, kv_heads = config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    body_flops = 2.0 * sum(w.numel() for w in weights[:-1])  # per row
    head_flops = 2.0 * head.numel()  # per row, one position per row

    def attention_flops(rows: int, queries: int, keys: float) -> float:
        return 4.0 * rows * heads * head_dim * queries * keys * layers

    print(f"{args.model}: {weight_bytes / 1e6:.0f} MB of weight matrices, {B} distinct prompts of up to {P} "
          f"tokens, temperature 1, one thread, median of {args.repeats}")
    print(f"{'RxT':>7s} {'GB/s':>6s} {'GFLOP/s B':>10s} {'prefill':>8s} {'GFLOP/s':>8s} {'step ms':>8s} "
          f"{'floor s':>8s} {'marsi s':>8s} {'x floor':>8s}")
    ratios = []
    engine.generate(prompts, max_new_tokens=args.tokens[0], temperature=1.0, seed=0)  # warm-up
    for T in args.tokens:
        runs = []  # (marsi / floor, marsi s, floor s, bandwidth, rate at B rows, prefill s, rate at prefill rows, step s)
        for r in range(args.repeats):
            bw, rate_b, rate_p = bandwidth(), matmul_rate(shapes, B), matmul_rate(shapes, B * P)
            prefill = (weight_bytes / bw + (B * P * body_flops + B * head_flops
                                            + attention_flops(B, P, (P + 1) / 2)) / rate_p)
            steps = []
            for t in range(1, T):
                keys = P + t
                kv_bytes = 2.0 * layers * B * kv_heads * head_dim * keys * 4
                steps.append((weight_bytes + kv_bytes) / bw
                             + (B * (body_flops + head_flops) + attention_flops(B, 1, keys)) / rate_b)
            floor = prefill + sum(steps)
            seconds = time_it(lambda: engine.generate(prompts, max_new_tokens=T, temperature=1.0, seed=r))
            runs.append((seconds / floor, seconds, floor, bw, rate_b, prefill, rate_p, statistics.mean(steps)))
        ratio, seconds, floor, bw, rate_b, prefill, rate_p, step = sorted(runs)[(len(runs) - 1) // 2]
        ratios.append(ratio)
        print(f"{B}x{T:<5d} {bw / 1e9:6.2f} {rate_b / 1e9:10.1f} {prefill:8.3f} {rate_p / 1e9:8.1f} "
              f"{1e3 * step:8.1f} {floor:8.3f} {seconds:8.3f} {ratio:8.2f}", flush=True)
    print(f"after: {bc.load_line()}")
    print(f"decode: marsi / floor {ratios[0]:.2f} at {B}x{args.tokens[0]}")


if __name__ == "__main__":
    main()
