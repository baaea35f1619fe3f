"""Parts of a SmolLM2 step that marsi's sampling and update choices change, each beside the earlier method.

    python benchmarks/sampling_parts.py [--model builtin:smollm2-135m-instruct] [--repeats 5] [--only PART]

One thread, the two methods of each part alternating, medians over `--repeats`:

  log-probs     forward + backward of the completion tokens' log-probs and the entropy from (8, 32, V) bf16
                logits at temperature 0.7 (what the update does after the model), top-k 50 and top-k off: the whole
                vocabulary masked to -inf (the earlier method) against `sampling.token_logps`, which
                carries the top-k candidates only
  top-k         the top-k candidates of (8, 32, V) bf16 logits (ties at the k-th value are common in bf16):
                a top-k pass, then a second one over the whole vocabulary when the k-th value is tied
                (earlier) against one pass of top_k + 16, which holds the ties unless they run past it
  noise         one decode step's sampling noise for 8 rows: `exponential_` over the vocabulary (earlier)
                against float64 uniforms (the exponential race's -log u, over 50 candidates)
  decode step   one token of an 8-row decode of the model (after a 90-token prefill), autocast bf16 and
                fp32, under `inference_mode` (earlier) against `no_grad`: autocast keeps its casts of the
                weights for the call only outside inference mode
  static step   one fp32 decode step as above: the model's forward (a DynamicCache grown by concatenation, the
                mask built per step, earlier) against `decode_step.StaticDecoder` (a static cache written in
                place, the mask built once, the same torch calls without the modules)
  KV cache      one bf16 decode step with the keys cached in float32 (what autocast's rotary embedding
                leaves; attention casts them at every step) against cached in bf16 (`keys_as_values_cache`)
  attention     forward + backward of the update's model pass (8 x 32 new tokens after 2 distinct
                90-token prompts, bf16 autocast) with SDPA (earlier) against `agent_trainer.attention`
                (short attentions written out as two matrix products, longer ones SDPA's)
  decode attn   one layer's attention at a decode step with a padding mask, bf16 autocast, 8 rows x 100
                cached tokens, SmolLM2's 9 query / 3 key heads, repeated 30 times (a step's layers):
                transformers' SDPA path, which copies the keys and values per query head (`repeat_kv`,
                earlier), against `agent_trainer.attention` (SDPA's `enable_gqa`, no copies)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

import bench_common as bc  # noqa: E402
from agent_trainer import attention, losses, sampling, shared_prompts  # noqa: E402
from agent_trainer.decode_step import StaticDecoder  # noqa: E402
from agent_trainer.models import load_model  # noqa: E402

B, T, PROMPT = 8, 32, 90
TEMPERATURE = 0.7  # the update divides by each completion's temperature


def dense_token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float,
                      top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The earlier method: (B, T, V) float32 tempered logits with -inf outside the top-k set (the token kept)."""
    z = logits.float() / temperature
    if top_k:
        kth = z.detach().topk(top_k, dim=-1).values[..., -1:]
        removed = (z.detach() < kth).scatter(-1, tokens.unsqueeze(-1), False)
        z = z.masked_fill(removed, float("-inf"))
    return z.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1), z


def two_pass_candidates(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The earlier method: the ids at or above the k-th logit, with a second top-k when the k-th value is tied."""
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    width = int((logits >= kth).sum(-1).max())
    return logits.topk(width, dim=-1).indices


def time_it(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", default="", help="time only the parts whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"$ python {' '.join(sys.argv)}\nbefore: {bc.load_line()}", flush=True)
    print(bc.machine_line())
    model, _ = load_model(args.model)
    model.eval()
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(B, T, V, generator=gen).mul(3).bfloat16()
    tokens = torch.randint(0, V, (B, T), generator=gen)

    def logps(method, top_k):
        def run():
            z = logits.clone().requires_grad_()
            values, candidates = (dense_token_logps(z, tokens, TEMPERATURE, top_k) if method == "earlier"
                                  else sampling.token_logps(z, tokens, TEMPERATURE, top_k))
            values.sum().backward()
            with torch.no_grad():
                losses.entropy_from_logits(candidates)
        return run

    uniform = torch.empty(B, V, dtype=torch.float64)
    exponential = torch.empty(B, V)
    ids = torch.randint(0, V, (B, 50), generator=gen)
    prompts = torch.randint(0, V, (2, PROMPT), generator=gen).repeat_interleave(B // 2, 0)
    mask = torch.ones_like(prompts)

    cast_keys_cache = shared_prompts.keys_as_values_cache

    def decode_step(mode, dtype, keys_cast=True):
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()

        def run():
            shared_prompts.keys_as_values_cache = (cast_keys_cache if keys_cast
                                                   else lambda model: DynamicCache(config=model.config))
            with mode(), autocast:  # a prefill, then one timed step inside the same call
                logits, cache = shared_prompts.prefill(model, prompts, mask, torch.arange(B))
                next_mask = torch.cat([mask, mask.new_ones(B, 1)], 1)
                start = time.perf_counter()
                model(input_ids=logits[:, -1].argmax(-1, keepdim=True), attention_mask=next_mask,
                      position_ids=torch.full((B, 1), PROMPT), use_cache=True, logits_to_keep=1,
                      **{shared_prompts.cache_argument(model): cache})
                run.seconds = time.perf_counter() - start
            shared_prompts.keys_as_values_cache = cast_keys_cache
        return run

    def static_step(static):
        def run():
            with torch.no_grad():
                logits, cache = shared_prompts.prefill(model, prompts, mask, torch.arange(B))
                token, position = logits[:, -1].argmax(-1), torch.full((B, 1), PROMPT)
                decoder = StaticDecoder(model, cache, mask, 1) if static else None
                start = time.perf_counter()
                if static:
                    decoder(token, position)
                else:
                    model(input_ids=token.unsqueeze(1), attention_mask=torch.cat([mask, mask.new_ones(B, 1)], 1),
                          position_ids=position, use_cache=True, logits_to_keep=1,
                          **{shared_prompts.cache_argument(model): cache})
                run.seconds = time.perf_counter() - start
        return run

    distinct, index = torch.randint(0, V, (2, PROMPT), generator=gen), torch.arange(B) // (B // 2)
    completions = torch.randint(0, V, (B, T), generator=gen)

    def update_pass(implementation):
        attention.install()  # the marsi contender's name, whichever runs first

        def run():
            model.set_attn_implementation(implementation)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = shared_prompts.completion_logits(model, distinct, torch.ones_like(distinct), index, completions,
                                                       torch.ones_like(completions))
            out.float().logsumexp(-1).sum().backward()
            model.zero_grad(set_to_none=True)
            model.set_attn_implementation(attention.NAME)
        return run

    heads, kv_heads, head_dim = (model.config.num_attention_heads, model.config.num_key_value_heads,
                                 model.config.hidden_size // model.config.num_attention_heads)
    layer = model.model.layers[0].self_attn
    query = torch.randn(B, heads, 1, head_dim, generator=gen).bfloat16()
    cached_keys = torch.randn(B, kv_heads, 100, head_dim, generator=gen)  # float32, as rotary leaves them
    cached_values = torch.randn(B, kv_heads, 100, head_dim, generator=gen).bfloat16()
    padding = torch.ones(B, 1, 1, 100, dtype=torch.bool)
    padding[: B // 2, :, :, :10] = False  # half the rows left-padded

    def decode_attention(forward):
        def run():
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                for _ in range(30):
                    forward(layer, query, cached_keys, cached_values, padding, scaling=head_dim ** -0.5)
        return run

    parts = {
        "log-probs, top-k 50": {"earlier (whole vocabulary)": logps("earlier", 50), "marsi (candidates)": logps("marsi", 50)},
        "log-probs, top-k off": {"earlier (whole vocabulary)": logps("earlier", 0), "marsi": logps("marsi", 0)},
        "top-k candidates": {"earlier (second pass on ties)": lambda: two_pass_candidates(logits, 50),
                             "marsi (top_k + 16 in one pass)": lambda: sampling.candidates(logits, 1.0, 50)},
        "noise per decode step": {"earlier (exponential_)": lambda: exponential.exponential_(generator=gen),
                                  "marsi (float64 uniform, -log)": lambda: -uniform.uniform_(generator=gen)
                                  .gather(1, ids).log()},
        "decode step, bf16": {"earlier (inference_mode)": decode_step(torch.inference_mode, "bf16"),
                              "marsi (no_grad)": decode_step(torch.no_grad, "bf16")},
        "decode step, bf16 keys": {"earlier (float32 keys cached)": decode_step(torch.no_grad, "bf16", False),
                                   "marsi (keys cached as bf16)": decode_step(torch.no_grad, "bf16")},
        "decode step, fp32": {"earlier (inference_mode)": decode_step(torch.inference_mode, "fp32"),
                              "marsi (no_grad)": decode_step(torch.no_grad, "fp32")},
        "decode step, fp32 static": {"earlier (the model's forward)": static_step(False),
                                     "marsi (StaticDecoder)": static_step(True)},
        "decode attention, x30": {"earlier (repeat_kv + SDPA)": decode_attention(sdpa_attention_forward),
                                  "marsi (SDPA enable_gqa)": decode_attention(attention.attention_forward)},
        "update pass, bf16": {"earlier (sdpa)": update_pass("sdpa"),
                              "marsi (short ones written out)": update_pass(attention.NAME)},
    }
    print(f"{args.model}: {B} rows, 1 thread, median of {args.repeats}")
    print(f"{'part':24s} {'method':32s} {'ms':>9s} {'x first':>10s}")
    for part, methods in parts.items():
        if args.only not in part:
            continue
        times = {name: [] for name in methods}
        for r in range(args.repeats + 1):
            for name, fn in (methods.items() if r % 2 == 0 else reversed(methods.items())):
                seconds = time_it(fn)
                if r:  # the first round warms up
                    times[name].append(getattr(fn, "seconds", seconds))
        first = None
        for name, values in times.items():
            ms = statistics.median(values) * 1000
            first = first or ms
            print(f"{part:24s} {name:32s} {ms:9.1f} {ms / first:10.2f}")
    print(f"after: {bc.load_line()}")


if __name__ == "__main__":
    main()
