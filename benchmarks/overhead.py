"""The same marsi step three ways, side by side: Coordinator with Ray actors, Coordinator with Ray off
(in-process trainers), and a plain hand-written loop calling the AgentTrainers directly.

    python benchmarks/overhead.py [--agents 2] [--steps 30] [--block 3] [--batch 8] [--group 4] [--tokens 4]
                                  [--model builtin:tiny]

Task and settings: `bench_common` (the vs_comlrl task: N roles, one turn, all act at once, shared
reward). Every trainer has one torch thread: the Ray actors run the agents in parallel, one process
each; Ray off and the plain loop run them one after the other in this process. The three alternate in
blocks of K steps (who goes first rotates); seconds per step is the median over blocks.

Where a step's time goes, per contender:
  trainers      the slowest agent's own generate + update seconds (GenerateResult/UpdateResult.seconds),
                or their sum where agents run one after the other
  calls         the driver's wall time of the generate and update calls minus `trainers`: for Ray,
                transport, (de)serialisation, scheduling, and waiting on the slower agent's sibling
  coordinator   the rest of the step: playing episodes (env reset/step, prompt gathering), advantages,
                Experience messages, metrics
The totals' differences also carry noise in the trainers' own compute (same work in all three), so
the script prints the coordinator's and Ray's shares as measured directly, next to the ratios.
"""

import argparse
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import bench_common as bc  # noqa: E402
from agent_trainer.trainer import AgentTrainer  # noqa: E402
from orchestrator.advantages import group_relative_advantages  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402
from orchestrator.rollout import derive_seed  # noqa: E402
from protocols.messages import Experience, GenerateRequest, UpdateRequest  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="steps per contender (a multiple of --block)")
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model", default="builtin:tiny")
    args = parser.parse_args()
    blocks = max(1, args.steps // args.block)
    steps = blocks * args.block
    kw = dict(num_agents=args.agents, model=args.model, batch_size=args.batch, group=args.group, tokens=args.tokens,
              lr=args.lr, steps=steps)
    print(f"marsi overhead: {args.agents} agent(s) on {args.model}, {args.batch} samples x {args.group} episodes per "
          f"step, {args.tokens} new tokens, 1 torch thread per trainer, {blocks} blocks of {args.block} steps")
    print(f"before: {bc.load_line()}")
    print(bc.machine_line())

    start = time.perf_counter()
    with ExitStack() as stack:
        contenders = {
            "Ray actors": CoordinatorRunner(stack.enter_context(Coordinator(bc.marsi_config(**kw, ray=True))), True),
            "Ray off": CoordinatorRunner(stack.enter_context(Coordinator(bc.marsi_config(**kw, ray=False))), False),
            "plain loop": PlainLoop(bc.marsi_config(**kw, ray=False)),
        }
        print(f"set-up: {time.perf_counter() - start:.1f} s")
        names = list(contenders)
        for b in range(blocks):
            for name in names[b % len(names):] + names[:b % len(names)]:
                contenders[name].block(b, args.block)
            print(f"block {b + 1}/{blocks}: " + "; ".join(f"{n} {c.seconds[-1]:.3f} s/step" for n, c in contenders.items()),
                  flush=True)
        round_trips = []  # Ray's fixed cost of one fan-out + gather: an empty call to every actor
        for _ in range(20):
            with bc.timed(round_trips):
                contenders["Ray actors"].coord.pool.info()
    print(f"after: {bc.load_line()}")

    print(f"\n{'contender':12s} {'s/step':>7s} {'vs plain':>8s} {'trainers':>9s} {'calls':>7s} {'coordinator':>11s}   "
          f"(per step, mean over all steps; trainers = generate + update)")
    plain = bc.median(contenders["plain loop"].seconds)
    for name, c in contenders.items():
        med = bc.median(c.seconds)
        n = len(c.seconds) * args.block
        print(f"{name:12s} {med:7.3f} {med / plain:8.2f} {c.parts['trainers'] / n:9.3f} {c.parts['calls'] / n:7.3f} "
              f"{c.parts['coordinator'] / n:11.3f}   (generate {c.parts['generate'] / n:.3f}, update "
              f"{c.parts['update'] / n:.3f} of trainers)")
    ray_s, off_s = bc.median(contenders["Ray actors"].seconds), bc.median(contenders["Ray off"].seconds)
    per = {name: {k: v / (len(c.seconds) * args.block) for k, v in c.parts.items()} for name, c in contenders.items()}
    ray, off, hand = per["Ray actors"], per["Ray off"], per["plain loop"]
    print(f"\nmedian step ratios: Ray off / plain loop {off_s / plain:.2f}, Ray actors / Ray off {ray_s / off_s:.2f}, "
          f"Ray actors / plain loop {ray_s / plain:.2f}")
    print(f"coordinator's own time per step: {off['coordinator'] * 1e3:.1f} ms with Ray off, {ray['coordinator'] * 1e3:.1f} ms "
          f"with Ray ({ray['coordinator'] / ray_s:.1%} of a Ray step); the plain loop's own bookkeeping: "
          f"{hand['coordinator'] * 1e3:.1f} ms")
    print(f"Ray's share with actors (call wall time beyond the slowest trainer): {ray['calls'] * 1e3:.1f} ms per step "
          f"({ray['calls'] / ray_s:.1%} of a Ray step); an empty fan-out + gather to the {args.agents} actor(s) takes "
          f"{bc.median(round_trips) * 1e3:.1f} ms (median of 20), and a step makes 2 (generate, update)")
    print(f"trainers' own compute per step: Ray actors {ray['trainers']:.3f} s (slowest agent), Ray off "
          f"{off['trainers']:.3f} s and plain loop {hand['trainers']:.3f} s (agents one after the other)")


class CoordinatorRunner:
    """Steps a started Coordinator through `run(until=...)`, splitting each step's time."""

    def __init__(self, coord: Coordinator, parallel: bool):
        self.coord, self.parallel = coord, parallel
        self.calls = bc.CallTimes(coord.pool)
        self.seconds: list[float] = []
        self.parts = dict.fromkeys(("generate", "update", "trainers", "calls", "coordinator"), 0.0)

    def block(self, b: int, size: int) -> None:
        self.calls.reset()
        with bc.timed(self.seconds, divide_by=size):
            history = self.coord.run(until=(b + 1) * size)
        own = self.calls.trainer if self.parallel else self.calls.trainer_sum
        for method in ("generate", "update"):
            self.parts[method] += own.get(method, 0.0)
            self.parts["trainers"] += own.get(method, 0.0)
            self.parts["calls"] += self.calls.wall.get(method, 0.0) - own.get(method, 0.0)
        self.parts["coordinator"] += sum(m["time/coordinator"] for m in history)


class PlainLoop:
    """The same step written by hand: generate per agent, shared reward, GRPO advantages, update per agent."""

    def __init__(self, config):
        self.config = config
        self.trainers = [AgentTrainer(name, agent, config.algorithm, seed=config.train.seed + i,
                                      total_updates=config.train.steps)
                         for i, (name, agent) in enumerate(config.agents.items())]
        self.rows = bc.task_rows(config.train.steps * config.train.batch_size, config.train.seed)
        self.step = 0
        self.seconds: list[float] = []
        self.parts = dict.fromkeys(("generate", "update", "trainers", "calls", "coordinator"), 0.0)

    def block(self, b: int, size: int) -> None:
        start = time.perf_counter()
        for _ in range(size):
            self.one_step()
        self.seconds.append((time.perf_counter() - start) / size)

    def one_step(self) -> None:
        start = time.perf_counter()
        B, G = self.config.train.batch_size, self.config.train.num_generations
        samples = [s for s in self.rows[self.step * B:(self.step + 1) * B] for _ in range(G)]
        results = []
        for i, trainer in enumerate(self.trainers):
            torch.set_num_threads(1)
            prompts = [bc.role_prompt(i, s["target"]) for s in samples]
            results.append(trainer.generate(GenerateRequest(prompts=prompts, seed=derive_seed(self.step, i))))
        rewards = bc.team_reward(*[[c.text for c in r.completions] for r in results], batch_items=samples)
        advantages = group_relative_advantages(rewards, [i // G for i in range(len(samples))])
        updates = []
        for trainer, result in zip(self.trainers, results):
            torch.set_num_threads(1)
            experiences = [Experience.from_completion(c, a) for c, a in zip(result.completions, advantages)]
            updates.append(trainer.update(UpdateRequest(experiences=experiences)))
        self.step += 1
        generate = sum(r.seconds for r in results)
        update = sum(u.seconds for u in updates)
        self.parts["generate"] += generate
        self.parts["update"] += update
        self.parts["trainers"] += generate + update
        self.parts["coordinator"] += time.perf_counter() - start - generate - update


if __name__ == "__main__":
    main()
