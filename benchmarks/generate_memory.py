"""Peak memory of one generate call on a model with Qwen2.5's 151,936-token vocabulary, side by side.

- `all-step logits`: transformers' `generate(output_logits=True)`, every step's logits stacked to
  (B, T, V) float32 and log-softmaxed afterwards: how behaviour log-probs were computed before marsi
  ran its own decode loop (reproduced here as the reference).
- `marsi decode loop`: `AgentTrainer.generate`, which keeps one log-prob per sampled token.

The model is a 2-layer Llama (hidden size 64) built in memory with a 151,936-token vocabulary and
saved to a temporary directory, so the vocabulary, not the network, dominates. Each contender runs
in a fresh subprocess (its one call's seconds are printed too, for scale, not as a speed benchmark); the figure is the peak resident memory during the call minus the resident
memory just before it (Linux: the peak is reset through /proc/self/clear_refs), or on CUDA the peak
of torch's allocator above what was allocated before.

    python benchmarks/generate_memory.py [--batch 16] [--tokens 64] [--vocab 151936] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_model(out: Path, vocab: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from agent_trainer.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("builtin:tiny"))  # ids past its 259 decode to ""
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)


def measure(kind: str, model_dir: str, batch: int, tokens: int, device: str) -> dict:
    """Runs in the child: load, then one generate of `batch` x `tokens`; peak memory of the call in MB."""
    import torch

    from agent_trainer import sampling
    from agent_trainer.trainer import AgentTrainer
    from protocols.config import AgentConfig, AlgorithmConfig
    from protocols.messages import GenerateRequest

    torch.set_num_threads(2)
    agent = AgentConfig(model=model_dir, dtype="float32", generation={"max_completion_length": tokens})
    trainer = AgentTrainer("bench", agent, AlgorithmConfig(), device=device)
    prompts = [f"Write a short sentence about the number {i}." for i in range(batch)]
    before = _memory_mark(device)
    start = time.perf_counter()
    if kind == "marsi decode loop":
        result = trainer.generate(GenerateRequest(prompts=prompts, seed=0))
        new_tokens = sum(len(c.completion_ids) for c in result.completions)
    else:
        from transformers import GenerationConfig

        from agent_trainer.engines import left_pad as _left_pad

        ids, mask = _left_pad([trainer.encode_prompt(p)[0] for p in prompts], trainer.tokenizer.pad_token_id,
                              trainer.device)
        config = GenerationConfig(do_sample=True, max_new_tokens=tokens, pad_token_id=trainer.tokenizer.pad_token_id,
                                  eos_token_id=trainer.tokenizer.eos_token_id, return_dict_in_generate=True,
                                  output_logits=True)
        with torch.inference_mode():
            out = trainer.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            completion_ids = out.sequences[:, ids.size(1):]
            logits = torch.stack(out.logits, dim=1)  # (B, T, V)
            sampling.token_logps(logits, completion_ids, 1.0)
        new_tokens = completion_ids.numel()
    seconds = time.perf_counter() - start
    return {"kind": kind, "peak_mb": _memory_peak(device) - before, "new_tokens": new_tokens, "seconds": seconds}


def _memory_mark(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set (VmHWM) to the current one
    return _status_mb("VmRSS")


def _memory_peak(device: str) -> float:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return _status_mb("VmHWM")


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], args.child[1], args.batch, args.tokens, args.device)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args.vocab)
        rows = []
        for kind in ("all-step logits", "marsi decode loop"):
            cmd = [sys.executable, __file__, "--child", kind, tmp, "--batch", str(args.batch),
                   "--tokens", str(args.tokens), "--device", args.device]
            # a fixed mmap threshold: glibc then returns every large freed block at once, so the resident
            # peak follows the live tensors instead of the allocator's reuse pattern (which varies run to run)
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    import bench_common as bc  # this script's folder is first on sys.path

    print(bc.machine_line())
    print(f"generate {args.batch} x {args.tokens} new tokens, vocabulary {args.vocab:,}, {args.device}")
    print(f"{'':20s} {'peak MB above load':>19s} {'new tokens':>11s} {'seconds':>8s}")
    for row in rows:
        print(f"{row['kind']:20s} {row['peak_mb']:19.0f} {row['new_tokens']:11d} {row['seconds']:8.2f}")
    print(f"ratio (decode loop / all-step logits): {rows[1]['peak_mb'] / rows[0]['peak_mb']:.3f}")


if __name__ == "__main__":
    main()
