"""marsi against CoMLRL (comlrl==1.4.3, MAGRPO) on the same two-agent, one-turn task, side by side.

    .venv/bin/pip install -e ".[bench]"      # once: the reference library
    python benchmarks/vs_comlrl.py [--models builtin:tiny,builtin:smollm2-135m-instruct] [--steps N]
        [--block K] [--batch B] [--group 4] [--tokens T] [--lr LR] [--threads 2] [--comlrl-threads 2,1]
        [--dtype float32|bfloat16|auto]

Both train two agents (two copies of the same model files) on `bench_common.TeamEnv`: each agent is
told a letter with its own verb, and the shared reward (`bench_common.team_reward`, the one function
both libraries call) is the fraction of agents whose answer starts with it. Same model files, group
of 4 completions per prompt, same max new tokens, steps, learning rate, optimizer, samples in the same
order, and the same CPU thread budget of 2: marsi runs one Ray actor per agent with num_cpus 1 (one
torch thread each, the two agents in parallel); CoMLRL runs both agents in this process, one after
the other, with torch.set_num_threads(2) -- and, in every other block, 1 thread, because on a busy
2-core machine two OpenMP threads that wait on each other can be several times slower than one.

A step is B samples x 4 completions per agent and one optimizer step per agent; CoMLRL reaches that
with rollout_buffer_size = train_batch_size = B. The contenders alternate in blocks of K steps (the one
going first alternates too), both living in this process the whole time (marsi's actors sit idle
while CoMLRL runs); seconds per step is the median over blocks. Reward: mean team reward of the first
and of the last block, and over all steps, for each library.
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")  # comlrl imports wandb; it is never initialised here
os.environ.setdefault("WANDB_SILENT", "true")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402

import bench_common as bc  # noqa: E402
from agent_trainer.models import resolve_model_path  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402

# Per-model defaults. The tiny model's team reward rises from about 0.04 to about 0.25 in 60 steps at
# lr 3e-3 (both libraries); SmolLM2-135M steps take seconds, so its few steps measure speed, not learning.
PRESETS = {
    "builtin:tiny": {"steps": 60, "block": 6, "batch": 8, "tokens": 4, "lr": 3e-3, "comlrl_threads": "2,1"},
    "builtin:smollm2-135m-instruct": {"steps": 4, "block": 1, "batch": 2, "tokens": 8, "lr": 1e-5,
                                      "comlrl_threads": "2,1"},
}
DEFAULT = {"steps": 10, "block": 2, "batch": 4, "tokens": 8, "lr": 1e-5, "comlrl_threads": "2"}


def main() -> None:
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="builtin:tiny,builtin:smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, help="training steps per contender (a multiple of --block)")
    parser.add_argument("--block", type=int, help="steps per timed block; contenders alternate per block")
    parser.add_argument("--batch", type=int, help="samples per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (num_generations)")
    parser.add_argument("--tokens", type=int, help="max new tokens")
    parser.add_argument("--lr", type=float)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of marsi, split between its 2 actors")
    parser.add_argument("--comlrl-threads", help="CoMLRL torch thread counts to run, e.g. 2 or 1,2 (default per model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                        help="marsi's dtype (CoMLRL stays float32): float32 runs the same computation in both; auto "
                             "is marsi's default, which measures this CPU and the model and picks")
    args = parser.parse_args()

    print(f"marsi vs CoMLRL, 2 agents, one turn; before: {bc.load_line()}")
    print(bc.machine_line())
    rows = []
    for model in args.models.split(","):
        settings = {**PRESETS.get(model, DEFAULT),
                    **{k: getattr(args, k) for k in ("steps", "block", "batch", "tokens", "lr") if getattr(args, k)}}
        rows.append(compare(model, args, **settings))
    print(f"after: {bc.load_line()}")
    print()
    print(f"{'model':30s} {'steps':>5s} {'contender':>10s} {'s/step':>8s} {'marsi/this':>10s} "
          f"{'team reward first -> last block':>32s} {'all steps':>9s}")
    for r in rows:
        for name, sec in r["seconds"].items():
            lib = name.split()[0]
            print(f"{r['model']:30s} {r['steps']:5d} {name:>10s} {sec:8.3f} {r['seconds']['marsi'] / sec:10.3f} "
                  f"{r['first'][lib]:22.3f} -> {r['last'][lib]:.3f} {r['all'][lib]:9.3f}")
    print()
    for r in rows:
        speed = ", ".join(f"{r['seconds']['marsi'] / sec:.3f} vs {name}" for name, sec in r["seconds"].items()
                          if name != "marsi")
        print(f"{r['model']}: ratio marsi/CoMLRL seconds per step {speed}; ratio marsi/CoMLRL team reward after "
              f"{r['steps']} steps {_ratio(r['last']['marsi'], r['last']['CoMLRL'])} (last block), "
              f"{_ratio(r['all']['marsi'], r['all']['CoMLRL'])} (all steps)")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "n/a (CoMLRL 0)"


def compare(model: str, args, *, steps: int, block: int, batch: int, tokens: int, lr: float,
            comlrl_threads: str) -> dict:
    blocks = max(1, steps // block)
    steps = blocks * block
    group, threads = args.group, args.threads
    comlrl_threads = [int(t) for t in str(args.comlrl_threads or comlrl_threads).split(",")]
    path = resolve_model_path(model)
    print(f"\n== {model} ({path})\n   {steps} steps of {batch} samples x {group} completions per agent, "
          f"{tokens} new tokens, lr {lr:g}, blocks of {block} steps; marsi: 2 Ray actors x {threads // 2} torch "
          f"thread(s), dtype {args.dtype}; CoMLRL: this process, {' then '.join(map(str, comlrl_threads))} torch thread(s) in turn per block")
    config = bc.marsi_config(num_agents=2, model=model, batch_size=batch, group=group, tokens=tokens, lr=lr,
                             steps=steps, ray=True, seed=args.seed, num_cpus=threads / 2, dtype=args.dtype)
    samples = bc.task_rows(steps * batch, args.seed)  # marsi reads the same rows, unshuffled
    seconds = {"marsi": [], **{f"CoMLRL {t}T": [] for t in comlrl_threads}}
    rewards = {"marsi": [], "CoMLRL": []}
    parts = {"generate": 0.0, "update": 0.0, "coordinator": 0.0, "trainer_generate": 0.0, "trainer_update": 0.0}
    updates: list[int] = []
    start = time.perf_counter()
    with Coordinator(config) as coord:
        calls = bc.CallTimes(coord.pool)
        comlrl = ComlrlRunner(path, batch=batch, group=group, tokens=tokens, lr=lr, seed=args.seed)
        print(f"   set-up (Ray, 2 actors, CoMLRL trainer): {time.perf_counter() - start:.1f} s")

        def run_marsi(b: int) -> str:
            calls.reset()
            with bc.timed(seconds["marsi"], divide_by=block):
                history = coord.run(until=(b + 1) * block)
            rewards["marsi"].append([m["reward/mean"] for m in history])
            for m in history:
                for part in ("generate", "update", "coordinator"):
                    parts[part] += m[f"time/{part}"]
            parts["trainer_generate"] += calls.trainer.get("generate", 0.0)
            parts["trainer_update"] += calls.trainer.get("update", 0.0)
            updates.append(sum(len(m["trained"]) for m in history))
            return "marsi"

        def run_comlrl(b: int) -> str:
            t = comlrl_threads[b % len(comlrl_threads)]
            with bc.timed(seconds[f"CoMLRL {t}T"], divide_by=block):
                per_step = comlrl.train(samples[b * block * batch:(b + 1) * block * batch], threads=t)
            rewards["CoMLRL"].append(per_step)
            return f"CoMLRL {t}T"

        for b in range(blocks):
            order = (run_marsi, run_comlrl) if b % 2 == 0 else (run_comlrl, run_marsi)  # who goes first alternates
            ran = [run(b) for run in order]
            print(f"   block {b + 1}/{blocks}: " + "; ".join(
                f"{n} {seconds[n][-1]:.3f} s/step, reward {_mean(rewards[n.split()[0]][-1]):.3f}" for n in sorted(ran,
                reverse=True)), flush=True)

    n, coord_updates = steps, sum(updates) // 2
    print(f"   marsi per step: generate {parts['generate'] / n:.3f} s (slowest trainer's own "
          f"{parts['trainer_generate'] / n:.3f}), update {parts['update'] / n:.3f} s (slowest trainer's own "
          f"{parts['trainer_update'] / n:.3f}), coordinator {parts['coordinator'] / n:.3f} s")
    for t, part in comlrl.seconds.items():
        total = sum(seconds[f"CoMLRL {t}T"]) * block
        k = len(seconds[f"CoMLRL {t}T"]) * block
        print(f"   CoMLRL {t}T per step: generate {part['generate'] / k:.3f} s, reward {part['reward'] / k:.4f} s, "
              f"update {part['update'] / k:.3f} s, rest {(total - sum(part.values())) / k:.3f} s")
    print(f"   optimizer steps per agent: marsi {coord_updates}, CoMLRL {comlrl.calls.get('update', 0) // 2}")
    result = {"model": model, "steps": steps, "seconds": {k: bc.median(v) for k, v in seconds.items() if v},
              "first": {k: _mean(v[0]) for k, v in rewards.items()},
              "last": {k: _mean(v[-1]) for k, v in rewards.items()},
              "all": {k: _mean(sum(v, [])) for k, v in rewards.items()}}
    m = result["seconds"]["marsi"]
    for name, c in result["seconds"].items():
        if name != "marsi":
            print(f"   ratio marsi / {name} seconds per step: {m / c:.3f} (medians {m:.3f} / {c:.3f} s, "
                  f"{len(seconds['marsi'])} / {len(seconds[name])} blocks)")
    print(f"   team reward after {steps} steps, first block -> last block (all steps): " + "; ".join(
        f"{k} {result['first'][k]:.3f} -> {result['last'][k]:.3f} ({result['all'][k]:.3f})" for k in rewards))
    return result


class ComlrlRunner:
    """CoMLRL's MAGRPOTrainer configured as close to the marsi run as its API allows.

    Differences it cannot remove (see benchmarks/README.md): it takes one sample per rollout and
    generates, scores and buffers one sample at a time; it recomputes log-probs one sequence at a time
    in the update; its loss sums token log-probs per sequence (marsi averages them) and includes the
    padding after an EOS; it samples in one process, agents one after the other.
    """

    def __init__(self, path: str, *, batch: int, group: int, tokens: int, lr: float, seed: int,
                 prompt_tokens: int = 0):
        from comlrl.trainers.reinforce import MAGRPOConfig, MAGRPOTrainer
        from datasets import Dataset

        self.Dataset = Dataset
        self.rewards: list[float] = []
        self.seconds: dict[int, dict[str, float]] = {}  # per thread count: generate, reward, update
        self.part = {}
        self.calls: dict[str, int] = {}  # calls of the timed methods: `update` counts optimizer steps
        torch.manual_seed(seed)
        args = MAGRPOConfig(
            num_train_epochs=1,               # one pass over the rows handed to each train() call
            agent_learning_rate=lr,
            num_agents=2,
            parallel_training="none",         # both agents in this process, one after the other
            agent_devices="cpu",
            num_generations=group,
            max_new_tokens=tokens,
            temperature=1.0, top_p=1.0, top_k=50,  # marsi samples with top_k 50 (transformers' default)
            num_turns=1,
            joint_mode="aligned",             # completion j of agent 0 pairs with completion j of agent 1
            early_termination_threshold=None,
            eval_interval=0,                  # no evaluation rollouts
            rollout_buffer_size=batch,        # update after `batch` samples ...
            train_batch_size=batch,           # ... in one optimizer step per agent
            advantage_normalization=True,     # (r - mean) / std within the group, as marsi's scale_rewards
            advantage_mode="mean",
            reference_kl_enabled=False,
            logging_steps=1,
        )
        formatters = [lambda item, i=i: bc.role_prompt(i, item["target"], prompt_tokens) for i in range(2)]
        self.trainer = MAGRPOTrainer(
            agent_model=path, num_agents=2, reward_func=self._reward, formatters=formatters,
            train_dataset=Dataset.from_list([{"target": "a"}]), args=args, wandb_config=None,
            model_config={"dtype": torch.float32},
        )
        self.trainer.verbose = False  # no tqdm bar per train() call
        self._time_method("_generate_completions_with_external_prompts", "generate")
        self._time_method("_update_from_samples", "update")

    def _reward(self, *completions, batch_items):
        start = time.perf_counter()
        rewards = bc.team_reward(*completions, batch_items=batch_items)
        self.rewards.extend(rewards)
        self.part["reward"] += time.perf_counter() - start
        return rewards

    def _time_method(self, name: str, key: str) -> None:
        inner = getattr(self.trainer, name)

        def timed(*a, **k):
            self.calls[key] = self.calls.get(key, 0) + 1
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.part[key] += time.perf_counter() - start

        setattr(self.trainer, name, timed)

    def train(self, rows: list[dict], threads: int) -> list[float]:
        """Train on `rows` (len(rows) / batch steps) with `threads` torch threads; the mean reward of each step."""
        torch.set_num_threads(threads)
        self.part = self.seconds.setdefault(threads, {"generate": 0.0, "reward": 0.0, "update": 0.0})
        self.rewards.clear()
        self.trainer.train_dataset = self.Dataset.from_list(rows)
        self.trainer.train()
        per_step = self.trainer.args.num_generations * self.trainer.args.rollout_buffer_size
        return [_mean(self.rewards[i:i + per_step]) for i in range(0, len(self.rewards), per_step)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


if __name__ == "__main__":
    main()
