"""GPU check of the learner and the rollout engines: log-prob gaps, bf16 autocast, sleep mode, generate time.

    python benchmarks/gpu_check.py [--model builtin:smollm2-135m-instruct] [--prompts 16] [--tokens 128]

Needs a CUDA GPU and torch with CUDA; Ray is not used (the trainer is driven in-process). `--model
random:smollm2` builds a model of SmolLM2-135M's shape (30 layers, width 576, 9 heads, 3 KV heads) with random
weights and builtin:tiny's byte tokenizer (so a 262-token vocabulary), saves it and loads it through
`from_pretrained` like any model: for a machine without the SmolLM2 package. It runs in one process, one agent
at a time, on GPU 0:

A. HF engine (marsi's decode loop on the learner's own weights), float32 without TF32: after each of two
   updates, the behaviour log-probs of the sampled tokens against the learner's (mean / max; fails above
   --tolerance), and the parameters moved.
B. bfloat16 under autocast over float32 master weights: after one update every parameter and the Adam state
   are still float32 and moved, the loss is finite, the behaviour gap is printed; the update's time against
   float32's on the same batch.
C. `dtype: auto` on this GPU (bf16 native from compute capability 8.0) is decided by measuring this model's shapes.
D. The optimizer state released between updates (`optimizer.offload: auto`, schedule-aware memory): device memory
   freed while it is in pinned CPU memory (fails below 80% of its size), and fetched back bit for bit.
E. The weight channel between a learner and its engine apart over NCCL, each on a GPU of its own
   (`benchmarks/gpu_channel.py`: transfer bit for bit, refusal, one bucket of extra memory, time against a copy
   between the devices); skipped with fewer than 2 GPUs.
With vLLM's GPU build installed (the `vllm-gpu` extra), also:

1. fp32 engine (weights float32, no TF32): after each of two updates (the tied embedding changes), the
   engine's log-probs of a fixed sequence match the learner's (max gap printed; fails above --tolerance);
   a weight change without sync shows as a gap, so the check can fail.
2. bf16 engine with sleep mode, as a training run would use it (learner float32 master weights, bfloat16
   autocast; engine bfloat16, gpu_memory_utilization 0.3): GPU memory freed while the engine sleeps during
   an update, the sync time, and the behaviour log-prob gap to the learner on sampled tokens (mean / max),
   which truncated importance sampling (rollout.tis_cap) corrects for.
3. Generate time, HF (marsi's decode loop) vs vLLM, `--prompts` x `--tokens` new tokens, stopping disabled
   (HF alone without vLLM).

Exit status 1 when a check fails; every number is printed either way. `--cpu` runs the same steps on CPU
(no sleep mode, no memory figures) to smoke-test this script where there is no GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from agent_trainer.trainer import AgentTrainer  # noqa: E402
from gpu_channel import SMOLLM2_SHAPE, check_weight_channel  # noqa: E402
from protocols.config import AgentConfig, AlgorithmConfig  # noqa: E402
from protocols.messages import Experience, GenerateRequest, UpdateRequest  # noqa: E402

PROMPTS = [f"Write a long story about a {thing}." for thing in (
    "lighthouse", "violin", "glacier", "robot", "market", "dragon", "river", "train",
    "garden", "comet", "library", "fox", "storm", "bakery", "castle", "desert")]


GPU = True  # False with --cpu


def random_smollm2(out: Path) -> str:
    """A model of SmolLM2-135M's shape with random weights and builtin:tiny's byte tokenizer, saved in `out`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from agent_trainer.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))
    config = LlamaConfig(**SMOLLM2_SHAPE, vocab_size=len(tok), max_position_embeddings=2048, rope_theta=100000.0,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def trainer(model: str, agent_dtype: str, engine: str, tokens: int, **vllm) -> AgentTrainer:
    if engine == "vllm":
        vllm = {"gpu_memory_utilization": 0.3, **vllm} if GPU else {"kv_cache_gb": 0.5}
    rollout = {"engine": engine, **({"vllm": vllm} if engine == "vllm" else {})}
    agent = AgentConfig(model=model, dtype=agent_dtype, resources={"num_gpus": int(GPU)},
                        optimizer={"lr": 1e-4, "weight_decay": 0.1}, generation={"max_completion_length": tokens},
                        rollout=rollout)
    return AgentTrainer(f"{engine}-{agent_dtype}", agent, AlgorithmConfig(), seed=0)


def synchronize() -> None:
    if GPU:
        torch.cuda.synchronize()


def free_memory() -> int:
    return torch.cuda.mem_get_info()[0] if GPU else 0


def fixed(t: AgentTrainer) -> list[Experience]:
    ids = t.encode_prompt("Name three colours.")[0]
    return [Experience(prompt_ids=ids, completion_ids=t.tokenizer("Red, green and blue.").input_ids, advantage=0.0)]


def machine_line() -> str:
    """What the figures were measured on (bench_common's line, without its `datasets` import: the GPU machine may
    lack that package)."""
    from agent_trainer.precision import capabilities, describe

    gpu = f"; {describe(capabilities('cuda'))}" if torch.cuda.is_available() else "; no GPU"
    return f"machine: {describe(capabilities('cpu'))}, {os.cpu_count()} CPUs{gpu}"


def device_name() -> str:
    return torch.cuda.get_device_name(0) if GPU else "CPU"


def gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def one_update(t: AgentTrainer, seed: int):
    result = t.generate(GenerateRequest(prompts=PROMPTS[:8], seed=seed))
    exps = [Experience.from_completion(c, a) for c, a in zip(result.completions, [1.0, -1.0] * 4)]
    return t.update(UpdateRequest(experiences=exps)), result


def moved(before: dict[str, torch.Tensor], t: AgentTrainer) -> float:
    """The share of parameter tensors that changed since `before`."""
    now = dict(t.model.named_parameters())
    return sum(not torch.equal(before[n], now[n].detach()) for n in before) / len(before)


def check_hf_engine(args) -> bool:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    t = trainer(args.model, "float32", "hf", 32)
    ok = True
    for step in (1, 2):
        before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        metrics, _ = one_update(t, step)
        share = moved(before, t)
        ok &= metrics.logp_gap_max < args.tolerance and share > 0.5
        print(f"[A: hf fp32] update {step}: {share:.0%} of parameter tensors moved; behaviour log-prob gap to the "
              f"learner mean {metrics.logp_mismatch:.2e} max {metrics.logp_gap_max:.2e} (tolerance {args.tolerance:g})",
              flush=True)
    t.close()
    del t
    torch.cuda.empty_cache() if GPU else None
    return ok


def check_bf16_update(args) -> bool:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    seconds, ok = {}, True
    for dtype in ("float32", "bfloat16"):
        t = trainer(args.model, dtype, "hf", args.tokens)
        t.engine.stop_ids = []  # every completion runs to --tokens
        before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        one_update(t, 0)  # warm-up: kernels, allocator, Adam state
        metrics, _ = one_update(t, 1)
        seconds[dtype] = metrics.seconds - metrics.sync_seconds
        if dtype == "bfloat16":
            params = [p.dtype for p in t.model.parameters()]
            state = [v.dtype for s in t.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim]
            masters = all(d == torch.float32 for d in params + state) and bool(state)
            share = moved(before, t)
            ok &= masters and share > 0.5 and math.isfinite(metrics.loss) and metrics.logp_mismatch < 0.1
            print(f"[B: hf bf16 autocast] {t.precision.dtype} ({t.precision.reason}); parameters and Adam state float32: "
                  f"{masters}; {share:.0%} of parameter tensors moved over 2 updates; loss {metrics.loss:.4f}; behaviour "
                  f"log-prob gap mean {metrics.logp_mismatch:.2e} max {metrics.logp_gap_max:.2e}", flush=True)
        t.close()
        del t
        torch.cuda.empty_cache() if GPU else None
    print(f"[B] update of 8 x {args.tokens} new tokens, learner only: float32 {seconds['float32']:.3f} s, bfloat16 "
          f"autocast {seconds['bfloat16']:.3f} s ({seconds['float32'] / seconds['bfloat16']:.2f}x)", flush=True)
    return ok


def check_optimizer_release(args) -> bool:
    """D. The schedule's release of an agent's AdamW state between its updates (`optimizer.offload: auto`): to
    pinned CPU memory from a GPU (a scratch file on CPU), then fetched back on a side stream."""
    t = trainer(args.model, "float32", "hf", 8)
    one_update(t, 0)  # the Adam state exists
    params = [p for group in t.optimizer.param_groups for p in group["params"]]

    def state() -> dict:
        return {(i, k): v.detach().clone() for i, p in enumerate(params) for k, v in t.optimizer.state.get(p, {}).items()
                if torch.is_tensor(v)}

    before = state()
    size = sum(v.numel() * v.element_size() for v in before.values())
    synchronize()
    held = torch.cuda.memory_allocated() if GPU else 0
    t.hold_optimizer(False)
    t.offload.wait()
    synchronize()
    freed = held - (torch.cuda.memory_allocated() if GPU else 0)
    t.hold_optimizer(True)
    t.offload.resident()
    after = state()
    same = before.keys() == after.keys() and all(torch.equal(before[k], after[k].to(before[k].device)) for k in before)
    ok = same and bool(before) and (not GPU or freed > 0.8 * size)
    print(f"[D: optimizer release] {size / 2**30:.2f} GiB of AdamW state; device memory freed while released "
          f"{freed / 2**30:.2f} GiB{'' if GPU else ' (CPU: not measured here)'}; fetched back bit for bit: {same}",
          flush=True)
    t.close()
    del t
    torch.cuda.empty_cache() if GPU else None
    return ok


def check_auto_precision(args) -> bool:
    from agent_trainer.precision import choose

    start = time.perf_counter()
    chosen = choose("auto", torch.device("cuda" if GPU else "cpu"), model=args.model)
    print(f"[C: dtype auto] {chosen.dtype} ({chosen.reason}; decided in {time.perf_counter() - start:.2f} s)", flush=True)
    return "measured" in chosen.reason or not GPU


def check_sync(args) -> bool:
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    t = trainer(args.model, "float32", "vllm", 32)
    ok = True
    seq = fixed(t)
    print(f"[fp32] start: fixed-sequence gap engine vs learner {gap(t.score(seq, engine=True), t.score(seq)):.2e}")
    for step in (1, 2):
        embedding = t.model.get_input_embeddings().weight.detach().clone()
        metrics, _ = one_update(t, step)
        moved = not torch.equal(embedding, t.model.get_input_embeddings().weight)
        g = gap(t.score(seq, engine=True), t.score(seq))
        ok &= g < args.tolerance and moved
        print(f"[fp32] update {step}: embedding moved {moved}, sync {metrics.sync_seconds:.3f} s, fixed-sequence gap "
              f"{g:.2e} (tolerance {args.tolerance:g}), sampled-token gap mean {metrics.logp_mismatch:.2e} "
              f"max {metrics.logp_gap_max:.2e}")
    with torch.no_grad():
        t.model.get_input_embeddings().weight.mul_(1.5)
    stale = gap(t.score(seq, engine=True), t.score(seq))
    t.engine.sync(t.model)
    fresh = gap(t.score(seq, engine=True), t.score(seq))
    ok &= stale > 10 * args.tolerance and fresh < args.tolerance
    print(f"[fp32] weights changed without sync: gap {stale:.2e}; after sync {fresh:.2e}")
    t.close()
    del t
    if GPU:
        torch.cuda.empty_cache()
    return ok


def check_sleep_and_gap(args) -> bool:
    t = trainer(args.model, "bfloat16", "vllm", args.tokens, sleep_mode=GPU)
    free_awake = free_memory()
    t.engine.sleep()
    free_asleep = free_memory()
    t.engine.sync(t.model)
    free_again = free_memory()
    print(f"[bf16, sleep mode] GPU memory freed by sleep: {(free_asleep - free_awake) / 2**30:.2f} GiB "
          f"(back after wake-up and sync: {(free_awake - free_again) / 2**30:+.2f} GiB difference)")
    gaps, syncs = [], []
    for step in (1, 2, 3):
        metrics, _ = one_update(t, step)
        gaps.append((metrics.logp_mismatch, metrics.logp_gap_max))
        syncs.append(metrics.sync_seconds)
    print(f"[bf16, sleep mode] 3 updates: sync {statistics.median(syncs):.3f} s (median); behaviour log-prob gap to "
          f"the learner, mean / max per update: " + ", ".join(f"{m:.2e} / {x:.2e}" for m, x in gaps)
          + f"; TIS weight of the last update {metrics.tis_weight:.4f}, truncated {metrics.tis_truncated:.3f}")
    ok = (free_asleep - free_awake > 2**28 or not GPU) and all(m < 0.1 for m, _ in gaps)
    t.close()
    del t
    if GPU:
        torch.cuda.empty_cache()
    return ok


def generate_times(args, engines: tuple[str, ...]) -> None:
    rows = []
    for engine in engines:
        for dtype in ("float32", "bfloat16"):
            start = time.perf_counter()
            t = trainer(args.model, dtype, engine, args.tokens)
            started = time.perf_counter() - start
            t.engine.stop_ids = []  # every completion runs to --tokens
            ids = [t.encode_prompt(p)[0] for p in PROMPTS[:args.prompts]]
            t.engine.generate(ids, max_new_tokens=8, temperature=1.0, seed=0)  # warm-up
            seconds = []
            for r in range(args.repeats):
                synchronize()
                start = time.perf_counter()
                t.engine.generate(ids, max_new_tokens=args.tokens, temperature=1.0, seed=r + 1)
                synchronize()
                seconds.append(time.perf_counter() - start)
            rows.append((engine, dtype, statistics.median(seconds), started))
            t.close()
            del t
            if GPU:
                torch.cuda.empty_cache()
    base = rows[0][2]
    print(f"\ngenerate {args.prompts} prompts x {args.tokens} new tokens on {device_name()}, "
          f"median of {args.repeats}:")
    print(f"{'engine':6s} {'dtype':9s} {'seconds':>8s} {'tokens/s':>9s} {'hf fp32 / this':>14s} {'start s':>8s}")
    for engine, dtype, seconds, started in rows:
        print(f"{engine:6s} {dtype:9s} {seconds:8.2f} {args.prompts * args.tokens / seconds:9.0f} "
              f"{base / seconds:14.2f} {started:8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct",
                        help="a model name, or random:smollm2 (SmolLM2's shape, random weights, byte tokenizer)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-3)
    parser.add_argument("--cpu", action="store_true", help="smoke-test on CPU: no sleep mode, no memory figures")
    args = parser.parse_args()
    global GPU
    GPU = not args.cpu
    if GPU and not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible to torch; run it on a machine with a GPU (or --cpu)")
    try:
        import vllm
    except ImportError as exc:
        vllm = None
        print(f"gpu_check: vLLM is not installed ({exc}): its checks are skipped (pip install -e '.[vllm-gpu]')")
    with tempfile.TemporaryDirectory(prefix="marsi-gpu-check-") as tmp:
        if args.model == "random:smollm2":
            args.model = random_smollm2(Path(tmp) / "random-smollm2")
        print(f"torch {torch.__version__}, vllm {vllm.__version__ if vllm else 'absent'}; {machine_line()}; "
              f"model {args.model}", flush=True)
        ok = check_hf_engine(args)
        ok &= check_bf16_update(args)
        ok &= check_auto_precision(args)
        ok &= check_optimizer_release(args)
        ok &= check_weight_channel(argparse.Namespace(layers=30, repeats=args.repeats, cpu=args.cpu))
        if vllm is not None:
            ok &= check_sync(args)
            ok &= check_sleep_and_gap(args)
        generate_times(args, ("hf", "vllm") if vllm is not None else ("hf",))
    print("gpu_check: " + ("all checks passed" if ok else "a check FAILED (see above)"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
