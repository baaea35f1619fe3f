"""Where an AgentTrainer's generate and update spend their time, measured by wrapping their parts.

    python benchmarks/profile_trainer.py [--model builtin:tiny] [--batch 32] [--group 4] [--tokens 4] [--repeats 5]
                                         [--threads 1] [--adamw]

One agent, the bench_common prompts, `--batch` prompts per call, `--group` in a row the same (as one marsi trainer gets them in
vs_comlrl.py: 8 samples x 4 episodes), one untimed warm-up call; totals are medians over repeats.
generate = the decode loop (`agent_trainer.sampling.sample`: forward passes with the KV cache, sampling,
the sampled tokens' log-probs) + prompt tokenisation + the rest (padding, decoding, Completion
messages). update = the forward that recomputes log-probs (`_token_logps`), backward,
optimizer.step, and the rest (collation, loss, statistics). `--adamw` also times one AdamW step over
the model's parameters with torch's default (for-loop) implementation, foreach=True and fused=True.
"""

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from agent_trainer import sampling  # noqa: E402
from agent_trainer.trainer import AgentTrainer  # noqa: E402
from protocols.messages import Experience, GenerateRequest, UpdateRequest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--batch", type=int, default=32, help="prompts per generate / sequences per update")
    parser.add_argument("--group", type=int, default=4, help="completions per distinct prompt")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--adamw", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="instruction tokens before each prompt")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = bc.marsi_config(num_agents=1, model=args.model, tokens=args.tokens, ray=False,
                             micro_batch_size=args.batch, lr=1e-5, dtype=args.dtype)
    trainer = AgentTrainer("a0", config.agents["a0"], config.algorithm, seed=0)
    print(bc.machine_line())
    print(f"{args.model}: {args.batch} prompts ({args.prompt_tokens}-token instruction; {args.group} per distinct prompt) "
          f"x {args.tokens} new tokens, "
          f"{args.dtype}, {args.threads} torch thread(s), "
          f"median of {args.repeats}; {bc.load_line()}")

    spent = defaultdict(float)
    where = {"in": None}

    def wrap(owner, name, key, only_in=None):
        inner = getattr(owner, name)

        def timed(*a, **k):
            if only_in is not None and where["in"] != only_in:
                return inner(*a, **k)
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start

        setattr(owner, name, timed)

    wrap(sampling, "sample", "generate/decode loop")
    wrap(trainer, "encode_prompt", "generate/prompt tokenisation")
    wrap(trainer, "_token_logps", "update/forward", only_in="update")
    wrap(torch.Tensor, "backward", "update/backward")
    wrap(trainer.optimizer, "step", "update/optimizer.step")

    prompts = [bc.role_prompt(0, bc.LETTERS[i // args.group % len(bc.LETTERS)], args.prompt_tokens)
               for i in range(args.batch)]  # `--group` rows in a row share a prompt
    rows = defaultdict(list)
    for r in range(args.repeats + 1):
        spent.clear()
        where["in"] = "generate"
        start = time.perf_counter()
        result = trainer.generate(GenerateRequest(prompts=prompts, seed=r))
        generate_s = time.perf_counter() - start
        experiences = [Experience.from_completion(c, (-1.0) ** i) for i, c in enumerate(result.completions)]
        where["in"] = "update"
        start = time.perf_counter()
        trainer.update(UpdateRequest(experiences=experiences))
        update_s = time.perf_counter() - start
        if r == 0:
            continue  # warm-up
        rows["generate"].append(generate_s)
        rows["update"].append(update_s)
        for key, value in spent.items():
            rows[key].append(value)
        rows["generate/rest"].append(generate_s - sum(v for k, v in spent.items() if k.startswith("generate/")))
        rows["update/rest"].append(update_s - sum(v for k, v in spent.items() if k.startswith("update/")))

    order = ["generate", "generate/decode loop", "generate/prompt tokenisation",
             "generate/rest", "update", "update/forward", "update/backward", "update/optimizer.step", "update/rest"]
    step = statistics.median(rows["generate"]) + statistics.median(rows["update"])
    print(f"{'part':32s} {'seconds':>8s} {'of call':>8s} {'of gen+upd':>10s}")
    for key in order:
        value = statistics.median(rows[key])
        call = statistics.median(rows[key.split("/")[0]])
        print(f"{key:32s} {value:8.4f} {value / call:8.1%} {value / step:10.1%}")

    if args.adamw:
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        print(f"AdamW.step over {sum(p.numel() for p in params) / 1e6:.1f}M parameters, {args.threads} thread(s):")
        for name, kw in (("default", {}), ("foreach=True", {"foreach": True}), ("fused=True", {"fused": True})):
            opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, **kw)
            opt.step()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - start)
            print(f"  {name:13s} {statistics.median(times):.3f} s")
            del opt


if __name__ == "__main__":
    main()
