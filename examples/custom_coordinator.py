"""A coordinator script with its own turn logic, built only from marsi's public primitives.

Alice hears a letter and says it; Bob hears only Alice and says what he heard. Both share the reward
(half for each right letter), and they train in alternation: Alice on even steps, Bob on odd ones.
It resumes exactly: every random choice derives from the step, each step ends with a checkpoint, and
the loop's own state (a running reward) travels in `coord.loop_state`.

    python examples/custom_coordinator.py [steps]             # a new run under runs/
    python examples/custom_coordinator.py [steps] RUN_DIR     # continue that run up to `steps`
"""

import random
import sys
from pathlib import Path

from orchestrator.advantages import group_relative_advantages
from orchestrator.coordinator import Coordinator
from orchestrator.runlog import make_run_dir
from protocols.config import load_config
from protocols.messages import Experience

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 60
GROUP, SAMPLES = 8, 8
if len(sys.argv) > 2:
    coord = Coordinator.resume(sys.argv[2])  # started, restored: coord.step and coord.loop_state are back
else:
    config = load_config(Path(__file__).parent / "demo" / "config.yaml", ["train.progress=false"])
    coord = Coordinator(config, run_dir=make_run_dir("runs/custom-coordinator-{time}", "custom"))

with coord:
    for step in range(coord.step, STEPS):
        rng = random.Random(step)  # randomness from the step alone: a resumed loop draws the same
        targets = [rng.choice("abcd") for _ in range(SAMPLES) for _ in range(GROUP)]
        said = coord.generate({"alice": [f"Say {t}" for t in targets]}, seed=2 * step)["alice"]  # turn 1
        heard = coord.generate({"bob": [f"Say {c.text[:1]}" for c in said]}, seed=2 * step + 1)["bob"]  # turn 2
        rewards = [0.5 * (a.text[:1] == t) + 0.5 * (b.text[:1] == t) for a, b, t in zip(said, heard, targets)]
        advantages = group_relative_advantages(rewards, [i // GROUP for i in range(len(targets))])
        agent, completions = ("alice", said) if step % 2 == 0 else ("bob", heard)
        result = coord.train({agent: [Experience.from_completion(c, a) for c, a in zip(completions, advantages)]})
        mean_reward = sum(rewards) / len(rewards)
        coord.loop_state["reward_ema"] = 0.9 * coord.loop_state.get("reward_ema", 0.0) + 0.1 * mean_reward
        print(f"step {step:3d}  reward {mean_reward:.3f}  trained {agent}  loss {result[agent].loss:+.4f}")
        coord.checkpoint(step=step + 1)
    print("run dir:", coord.log.dir, " reward_ema:", round(coord.loop_state.get("reward_ema", 0.0), 4))
