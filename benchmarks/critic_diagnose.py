"""Is the critic learning, and is its credit better than group baselines'? One run of critic_credit's task, read
step by step.

    python benchmarks/critic_diagnose.py [--method central|per_agent] [--turns 4] [--steps 60] [--seed 0]
        [--critic-lr 1e-3] [--every 5] [key=value ...]

Each step the same episodes are scored both ways: by the run's critic (which the agents train on) and, for
comparison only, by group baselines. On `TakeTurnsEnv` each action's own worth is known (did it say the
letter?), so the printed `credit` is the correlation, over the step's actions, between an action's advantage
and its own correctness: 1 would be perfect credit, and what the other turns' luck adds to an advantage
lowers it. Printed every `--every` steps: the reward, the critic's explained variance (before its update) and
value loss, its mean value per turn, and the credit of critic and group advantages, each averaged since the
last line. `key=value` extras override the critic section (e.g. `gae_lambda=1.0`, `num_iterations=2`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from critic_credit import turns_config  # noqa: E402


def correlation(xs: list[float], ys: list[float]) -> float:
    if len(xs) < 2 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return float("nan")
    return statistics.correlation(xs, ys)


def main() -> None:
    import torch
    import yaml

    from orchestrator.baselines import experiences_by_agent
    from orchestrator.coordinator import Coordinator
    from protocols.config import validate_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=("central", "per_agent"), default="central")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)

    raw = turns_config(args.steps, args.turns)
    raw["train"]["seed"] = args.seed
    raw["algorithm"]["baseline"] = "critic"
    raw["critic"] = {"kind": args.method, "model": "builtin:tiny", "num_iterations": 1,
                     "optimizer": {"lr": args.critic_lr}}
    for item in args.overrides:
        key, value = item.split("=", 1)
        raw["critic"][key] = yaml.safe_load(value)
    config = validate_config(raw, source=HERE.parent / "run.yaml")
    steps: list[dict[str, list[float]]] = []  # per step: what was watched

    class Watched(Coordinator):
        def values(self, states):
            values = super().values(states)
            steps.append(defaultdict(list))
            for critic, vs in values.items():
                steps[-1]["spread"].append(statistics.pstdev(vs) if len(vs) > 1 else 0.0)
                for s, v in zip(states[critic], vs):
                    seen = s.count("] > ")  # one line per past answer the critic sees
                    steps[-1][f"v{seen}"].append(v)
            return values

        def advantages(self, episodes):
            experiences_by_agent(episodes, config.algorithm.model_copy(update={"baseline": "group"}), {})
            group = [a.advantage for e in episodes for t in e.turns for a in t.actions]
            out = super().advantages(episodes)
            actions = [(e, a) for e in episodes for turn in e.turns for a in turn.actions]
            right = [float(a.completion.text[:1] == e.env.letter) for e, a in actions]
            steps[-1]["credit_critic"].append(correlation([a.advantage for _, a in actions], right))
            steps[-1]["credit_group"].append(correlation(group, right))
            return out

    with tempfile.TemporaryDirectory() as tmp, Watched(config, tmp) as coord:
        history = coord.run()
    print(f"{args.method} critic, {args.turns} turns, critic lr {args.critic_lr} {' '.join(args.overrides)}")
    print("steps     reward  expl.var  value_loss  credit critic / group  value spread  mean value by answers seen")

    def mean(xs: list[float]) -> float:  # NaN (a step with no spread) left out
        kept = [x for x in xs if x == x]
        return statistics.fmean(kept) if kept else float("nan")

    for a in range(0, len(history), args.every):
        h, w = history[a:a + args.every], steps[a:a + args.every]
        ev = mean([v for m in h for k, v in m.items() if k.startswith("critic/explained_variance/")])
        loss = mean([v for m in h for k, v in m.items() if k.startswith("critic/value_loss/")])
        seen = sorted({k for s in w for k in s if k.startswith("v")}, key=lambda k: int(k[1:]))
        values = " ".join(f"{mean([x for s in w for x in s[k]]):.3f}" for k in seen)
        print(f"{a + 1:3d}-{a + len(h):<3d}  {mean([m['reward/mean'] for m in h]):.3f}  {ev:+.3f}    {loss:.4f}     "
              f"{mean([x for s in w for x in s['credit_critic']]):+.3f} / "
              f"{mean([x for s in w for x in s['credit_group']]):+.3f}"
              f"      {mean([x for s in w for x in s['spread']]):.4f}      {values}", flush=True)
    critic_s = sum(m.get("time/critic", 0.0) for m in history)
    print(f"critic seconds {critic_s:.0f}")


if __name__ == "__main__":
    main()
