"""The task, configs and measuring helpers shared by the benchmark scripts (not a script itself).

Task: N roles, one turn, all roles act at once. Every role is told the sample's letter, each with its
own verb: "Letter: c" newline "Repeat the letter:" (role 0), "... Say the letter:" (role 1), ...
SmolLM2-135M-Instruct without its chat template answers this form right about half the time; the
random tiny model about 4% of the time. The team reward is the fraction of roles whose answer starts
with the letter. `team_reward` is the one reward function: marsi's `TeamEnv.step` calls it, and CoMLRL's
MAGRPOTrainer calls the very same object (benchmarks/ is on sys.path when a script here runs, and the
environment is named by the module spec `bench_common:TeamEnv`, so both sides share this module).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import datasets  # noqa: E402

from protocols.config import RunConfig, validate_config  # noqa: E402
from protocols.env import Environment, StepResult  # noqa: E402

LETTERS = "abcd"
VERBS = ("Repeat", "Say", "Write", "Type", "Print", "Spell", "Show", "Echo")


# ------------------------------------------------------------------------------------------ task
PREAMBLE = ("You are one member of a team. Each member is told the same letter and answers on its own; the team "
            "scores when every member answers with that letter first. ")


def preamble(tokens: int) -> str:
    """A fixed instruction of about `tokens` SmolLM2 tokens (about 4 characters each), put before the
    task's two lines so that prompts have realistic lengths; empty for 0."""
    text = (PREAMBLE * (1 + tokens * 4 // len(PREAMBLE)))[:tokens * 4]
    return text[:text.rfind(" ") + 1] + "\n" if tokens else ""


def role_prompt(role_index: int, target: str, prompt_tokens: int = 0) -> str:
    return f"{preamble(prompt_tokens)}Letter: {target}\n{VERBS[role_index]} the letter:"


def team_reward(*completions: list[str], batch_items: list[dict[str, Any]]) -> list[float]:
    """One float per joint action: the fraction of agents whose answer starts with the target letter.
    `completions[a][i]` is agent a's answer for `batch_items[i]` (CoMLRL's calling convention)."""
    rewards = []
    for i, item in enumerate(batch_items):
        right = [c[i].lstrip()[:1].lower() == item["target"] for c in completions]
        rewards.append(sum(right) / len(right))
    return rewards


class TeamEnv(Environment):
    """`num_roles` roles act once, all at the same time; shared reward: `team_reward`."""

    max_turns = 1

    def __init__(self, num_roles: int = 2, story: bool = False, prompt_tokens: int = 0):
        self.possible_agents = [f"role{i}" for i in range(num_roles)]
        self.story, self.prompt_tokens = story, prompt_tokens

    def reset(self, sample, seed=None):
        self.sample = sample
        if self.story:  # long answers, for generation-heavy steps (benchmarks/engines.py)
            return {r: f"Letter: {sample['target']}\nWrite a long story whose first word starts with the letter:"
                    for r in self.possible_agents}
        return {r: role_prompt(i, sample["target"], self.prompt_tokens) for i, r in enumerate(self.possible_agents)}

    def step(self, actions):
        self.reward = team_reward(*[[actions[r]] for r in self.possible_agents], batch_items=[self.sample])[0]
        return StepResult(prompts={}, reward=self.reward, terminated=True)

    def episode_info(self):
        return {"all_right": float(self.reward == 1.0)}


def task_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """`n` samples in a fixed seeded order; both libraries read them in this order."""
    rng = random.Random(seed)
    return [{"target": rng.choice(LETTERS)} for _ in range(n)]


def make_dataset(n: int = 64, seed: int = 0) -> datasets.Dataset:
    return datasets.Dataset.from_list(task_rows(n, seed))


# ---------------------------------------------------------------------------------------- config
def marsi_config(*, num_agents: int = 2, model: str = "builtin:tiny", batch_size: int = 8, group: int = 4,
                 tokens: int = 4, lr: float = 1e-3, steps: int = 10, ray: bool = True, seed: int = 0,
                 num_cpus: float = 1.0, ray_cpus: float | None = None, dataset_size: int | None = None,
                 micro_batch_size: int | None = None, engine: str = "hf", story: bool = False,
                 vllm: dict[str, Any] | None = None, prompt_tokens: int = 0, dtype: str = "float32",
                 checkpoint_every: int = 0, run_dir: str | None = None) -> RunConfig:
    """The benchmark's marsi run: `num_agents` agents a0.. on roles role0.., trained simultaneously.

    Settings chosen to match CoMLRL's MAGRPO (see vs_comlrl.py): plain-text prompts, temperature 1,
    top_p 1, top_k 50, AdamW with weight decay 0.01 (torch's AdamW default, which CoMLRL keeps),
    constant learning rate, no gradient clipping, GRPO advantages (mean-centred, divided by the
    group std), loss averaged per sequence, no KL, one pass over each batch.
    """
    agents = {
        f"a{i}": {
            "model": model,
            "dtype": dtype,
            "micro_batch_size": micro_batch_size or batch_size * group,
            "generation": {"max_completion_length": tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 50,
                           "use_chat_template": False},
            "optimizer": {"lr": lr, "weight_decay": 0.01, "lr_schedule": "constant", "warmup_steps": 0,
                          "max_grad_norm": None},
            "resources": {"num_cpus": num_cpus},
            "rollout": {"engine": engine, **({"vllm": vllm} if engine == "vllm" and vllm else {})},
        }
        for i in range(num_agents)
    }
    raw = {
        "agents": agents,
        "environment": {"name": "bench_common:TeamEnv", "kwargs": {"num_roles": num_agents, "story": story,
                                                                      "prompt_tokens": prompt_tokens}},
        "roles": {"assignment": {f"role{i}": f"a{i}" for i in range(num_agents)}},
        "data": {"factory": "bench_common:make_dataset", "shuffle": False,
                 "kwargs": {"n": dataset_size or steps * batch_size, "seed": seed}},
        "schedule": {"kind": "simultaneous"},
        "algorithm": {"baseline": "group", "scale_rewards": True, "beta": 0.0,
                      "num_iterations": 1, "loss_aggregation": "sequence"},
        "train": {"steps": steps, "batch_size": batch_size, "num_generations": group, "seed": seed,
                  "checkpoint_every": checkpoint_every, "transcripts_per_step": 0, "progress": False,
                  **({"run_dir": run_dir} if run_dir else {})},
        "ray": {"enabled": ray, "num_cpus": ray_cpus if ray_cpus is not None else num_agents * num_cpus},
    }
    return validate_config(raw, source="<benchmark>")


# ------------------------------------------------------------------------------------- measuring
def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine_line() -> str:
    """`machine: CPU AMD EPYC (avx512_bf16 yes, amx_bf16 no), 2 CPUs; GPU NVIDIA H100 (bf16 native)`: what the
    figures below were measured on, with what decides bf16's speed (`agent_trainer.precision`)."""
    import torch

    from agent_trainer.precision import capabilities, describe

    gpu = f"; {describe(capabilities('cuda'))}" if torch.cuda.is_available() else "; no GPU"
    return f"machine: {describe(capabilities('cpu'))}, {os.cpu_count()} CPUs{gpu}"


def load_line() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} CPUs)"


def rss_mb(pid: int) -> tuple[float, float]:
    """(current, peak) resident memory of a process in MB, from /proc (Linux)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return fields.get("VmRSS", float("nan")), fields.get("VmHWM", float("nan"))


class CallTimes:
    """Wraps a trainer pool's `each` to record, per `Agent` method, the driver's wall time of each call and
    the longest trainer-side `seconds` among its results (the compute of the slowest agent).
    wall - trainer = transport, (de)serialisation and scheduling around the trainers."""

    def __init__(self, pool):
        self.pool, self.inner = pool, pool.each
        self.wall: dict[str, float] = {}
        self.trainer: dict[str, float] = {}
        self.trainer_sum: dict[str, float] = {}
        pool.each = self.each

    def each(self, method, arguments, *, timeout=None):
        start = time.perf_counter()
        results = self.inner(method, arguments, timeout=timeout)
        name = method.__name__
        self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - start
        seconds = [getattr(r, "seconds", 0.0) for r in results.values()]
        self.trainer[name] = self.trainer.get(name, 0.0) + max(seconds, default=0.0)
        self.trainer_sum[name] = self.trainer_sum.get(name, 0.0) + sum(seconds)
        return results

    def reset(self) -> None:
        self.wall.clear()
        self.trainer.clear()
        self.trainer_sum.clear()


@contextmanager
def timed(into: list[float], divide_by: int = 1):
    start = time.perf_counter()
    yield
    into.append((time.perf_counter() - start) / divide_by)
