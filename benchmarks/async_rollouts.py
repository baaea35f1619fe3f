"""Step time against `train.max_staleness` K, with simulated agents: marsi's coordinator and its asynchronous
rollout pipeline, unchanged, driving agents that only sleep (no torch, no model).

    python benchmarks/async_rollouts.py [--generate 0.05] [--update 0.15] [--steps 16] [--ks 0 1 2 3]

Each agent sleeps `--generate` seconds per generate call and `--update` per update, one call at a time. The
environment has one turn per agent, one role acting per turn, so a rollout's turns follow one another:
G = agents x generate seconds. Two placements of the rollout engine:

  colocated  generate and update share the agent's one process (marsi's trainers today): an agent never does both
             at once, so the pipeline's gates make an update wait for the rollouts that need its old weights;
  separate   the engine runs apart from the learner (`engines_apart`, what `rollout.placement: separate` gives
             real trainers): an agent generates with an older version while its learner updates.

Bounds per step (the schedule's cycle averaged), printed beside each measurement:
  sync       G + U, with U the update seconds of a step where any agent trains: generate, then update;
  colocated  max(G, max over agents of generate + share-of-steps-it-trains x update): each agent one call at a time,
             rollouts played one after another;
  separate   max(G, U): the generation of the next rollouts hides under the updates or the reverse.
Figures are seconds per step from the steps' `time/end`, leaving out the first L + 1 steps (the pipeline filling)
and the last L (no rollouts left to play ahead), L the lag K gives under the schedule; runs are lengthened to keep
at least 6 steps measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent_trainer.agent import Agent  # noqa: E402
from agent_trainer.handle import TrainerPool  # noqa: E402
from protocols.env import Environment, StepResult  # noqa: E402
from protocols.messages import Completion, GenerateResult, UpdateResult  # noqa: E402

HERE = Path(__file__).resolve()


class TurnEnv(Environment):
    """One turn per role, in order; each turn one role acts. No reward: only the timing matters."""

    def __init__(self, roles=("r0", "r1")):
        self.possible_agents, self.max_turns = list(roles), len(roles)

    def reset(self, sample, seed=None):
        self.turn = 0
        return {self.possible_agents[0]: "go"}

    def step(self, actions):
        self.turn += 1
        done = self.turn >= self.max_turns
        return StepResult(prompts={} if done else {self.possible_agents[self.turn]: "go"}, reward=0.0, terminated=done)

    def episode_info(self):
        return {}


def samples(n: int = 64):
    import datasets

    return datasets.Dataset.from_list([{"i": i} for i in range(n)])


class SleepingAgents(TrainerPool):
    """A pool of simulated agents: a generate sleeps `generate_s`, an update `update_s`. Colocated, an agent's
    generate and update take one lock; apart, its engine and its learner each have their own."""

    def __init__(self, agents: list[str], generate_s: float, update_s: float, apart: bool):
        self.agents, self.generate_s, self.update_s = agents, generate_s, update_s
        self.engines_apart = set(agents) if apart else set()
        self.learner = {a: threading.Lock() for a in agents}
        self.engine = {a: threading.Lock() for a in agents} if apart else self.learner
        self.version = dict.fromkeys(agents, 0)
        self.start_info = {a: {"load_s": 0.0} for a in agents}

    def _one(self, method, agent, request):
        if method is Agent.generate:
            with self.engine[agent]:
                time.sleep(self.generate_s)
            version = request.policy_version if request.policy_version is not None else self.version[agent]
            return GenerateResult(agent=agent, seconds=self.generate_s, completions=[
                Completion(text="x", prompt_ids=[1], completion_ids=[2], per_token_logps=[-0.5], finish_reason="stop",
                           policy_version=version) for _ in request.prompts])
        if method is Agent.update:
            with self.learner[agent]:
                time.sleep(self.update_s)
                self.version[agent] += 1
            return UpdateResult(agent=agent, policy_version=self.version[agent], loss=0.0, grad_norm=0.0, kl=0.0,
                                entropy=0.0, clip_fraction=0.0, lr=0.0, num_tokens=len(request.experiences),
                                num_sequences=len(request.experiences), seconds=self.update_s)
        raise NotImplementedError(method.__name__)

    def _fan_out(self, method, calls, timeout):
        results, threads = {}, []
        for agent, args in calls.items():
            thread = threading.Thread(target=lambda a=agent, r=args[0]: results.__setitem__(a, self._one(method, a, r)))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
        return results

    def info(self, timeout=None):
        return self.start_info

    def close(self):
        pass


def config(agents: int, kind: str, k: int, steps: int):
    from protocols.config import validate_config

    names = [f"a{i}" for i in range(agents)]
    return validate_config({
        "agents": {a: {"model": "builtin:tiny"} for a in names},
        "environment": {"name": f"{HERE}:TurnEnv", "kwargs": {"roles": [f"r{i}" for i in range(agents)]}},
        "roles": {"assignment": {f"r{i}": a for i, a in enumerate(names)}},
        "data": {"factory": f"{HERE}:samples"},
        "schedule": {"kind": kind},
        "train": {"steps": steps, "batch_size": 1, "num_generations": 2, "progress": False, "max_staleness": k},
        "ray": {"enabled": False},
    })


def step_seconds(agents: int, kind: str, k: int, steps: int, generate_s: float, update_s: float,
                 apart: bool) -> tuple[float, int]:
    from orchestrator.coordinator import Coordinator

    probe = Coordinator(config(agents, kind, k, 1), None)  # its lag decides how many steps fill and drain the pipeline
    lag = probe.lag
    steps = max(steps, 2 * lag + 8)
    cfg = config(agents, kind, k, steps)
    coord = Coordinator(cfg, None)
    coord.session.start_trainers = lambda: SleepingAgents(list(cfg.agents), generate_s, update_s, apart)
    with coord:
        history = coord.run()
    ends = [m["time/end"] for m in history]
    first, last = lag + 1, steps - 1 - lag  # the pipeline filling and the last `lag` steps: left out
    worst = max((m[key] for m in history for key in m if key.startswith("staleness/") and key.endswith("/max")), default=0)
    return (ends[last] - ends[first]) / (last - first), worst


def bounds(agents: int, kind: str, generate_s: float, update_s: float) -> dict[str, float]:
    rollout = agents * generate_s  # one turn per agent, one after another
    share = 1.0 if kind == "simultaneous" else 1.0 / agents  # of the steps each agent trains at
    return {"sync": rollout + update_s, "colocated": max(rollout, generate_s + share * update_s),
            "separate": max(rollout, update_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generate", type=float, default=0.05, help="seconds per generate call")
    parser.add_argument("--update", type=float, default=0.15, help="seconds per update")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"generate {args.generate:g} s/call, update {args.update:g} s, {args.steps} steps; seconds per step "
          "(ratio to the synchronous bound), worst versions behind")
    for kind, agents in (("simultaneous", 2), ("simultaneous", 3), ("alternate", 2), ("round_robin", 3)):
        b = bounds(agents, kind, args.generate, args.update)
        print(f"\n{kind}, {agents} agents: bounds sync {b['sync']:.3f}, colocated {b['colocated']:.3f}, "
              f"separate {b['separate']:.3f}")
        for placement in ("colocated", "separate"):
            cells = []
            for k in args.ks:
                seconds, worst = step_seconds(agents, kind, k, args.steps, args.generate, args.update,
                                              placement == "separate")
                cells.append(f"K={k} {seconds:.3f} ({seconds / b['sync']:.2f}x, {worst} behind)")
            print(f"  {placement:9s} " + "  ".join(cells))
    print(f"\nload average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
