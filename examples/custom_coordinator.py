"""A coordinator script with its own turn logic, built only from marsi's public primitives and step helpers.

Alice hears a letter and says it; Bob hears only Alice and says what he heard. Both share the reward
(half for each right letter), and they train in alternation: Alice on even steps, Bob on odd ones.
It logs what `run()` logs (rewards, invalid rate, per-agent update statistics, zero-variance share, a spread
of episodes as transcripts, an evaluation at its last step), so `marsi plot`, `marsi report` and `marsi eval`
read its run directory as any other. It resumes exactly: every random choice derives from the step, each step
ends with a checkpoint, and the loop's own state (a running reward) travels in `coord.loop_state`.

    python examples/custom_coordinator.py [steps]             # a new run under runs/
    python examples/custom_coordinator.py [steps] RUN_DIR     # continue that run up to `steps`

docs/custom-coordinators.md walks through it.
"""

import random
import sys
from pathlib import Path

from orchestrator.advantages import group_relative_advantages
from orchestrator.console import progress
from orchestrator.coordinator import Coordinator
from orchestrator.rollout import Action, Turn
from orchestrator.runlog import make_run_dir
from orchestrator.steplog import episode_metrics, loop_episode, show_step, update_metrics, zero_variance_metrics
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
    bar = progress(coord.step, STEPS, coord.config.train.progress)  # the progress line run() shows
    for step in range(coord.step, STEPS):
        # rollout: two turns, each one batched generate; randomness from the step alone
        rng = random.Random(step)
        targets = [rng.choice("abcd") for _ in range(SAMPLES) for _ in range(GROUP)]
        asked = [f"Say {t}" for t in targets]
        said = coord.generate({"alice": asked}, seed=2 * step)["alice"]  # turn 1
        relayed = [f"Say {c.text[:1]}" for c in said]
        heard = coord.generate({"bob": relayed}, seed=2 * step + 1)["bob"]  # turn 2
        rewards = [0.5 * (a.text[:1] == t) + 0.5 * (b.text[:1] == t) for a, b, t in zip(said, heard, targets)]
        # advantages: group-relative over the episodes of one target (a group of GROUP)
        advantages = group_relative_advantages(rewards, [i // GROUP for i in range(len(targets))])
        agent, completions = ("alice", said) if step % 2 == 0 else ("bob", heard)
        # the episodes as marsi records them: the metrics, transcripts and `marsi report` read these
        episodes = []
        for i in range(len(targets)):
            turns = []
            for role, who, prompt, completion, reward in (("speaker", "alice", asked[i], said[i], 0.0),
                                                          ("listener", "bob", relayed[i], heard[i], rewards[i])):
                infos = {} if completion.text.strip() else {role: {"invalid": True, "reason": "said nothing"}}
                advantage = advantages[i] if who == agent else None  # shown in the report's episodes
                turns.append(Turn([Action(role, who, prompt, completion, advantage)], reward, infos))
            episodes.append(loop_episode(index=step * len(targets) + i, sample=i // GROUP,
                                         roles=["speaker", "listener"], turns=turns))
        # update
        result = coord.train({agent: [Experience.from_completion(c, a) for c, a in zip(completions, advantages)]})
        # log: what run() logs, to metrics.jsonl and transcripts.jsonl
        row = {"step": step + 1, "trained": [agent], **episode_metrics(episodes), **update_metrics(result),
               **zero_variance_metrics(episodes, coord.config.algorithm)}
        coord.log_step(row, episodes)
        mean_reward = row["reward/mean"]
        coord.loop_state["reward_ema"] = 0.9 * coord.loop_state.get("reward_ema", 0.0) + 0.1 * mean_reward
        print(f"step {step:3d}  reward {mean_reward:.3f}  trained {agent}  loss {result[agent].loss:+.4f}")
        show_step(bar, row)
        # evaluate (the config's eval: section), before the checkpoint, as run() does
        if step + 1 == STEPS and coord.evaluation is not None:
            coord.evaluate(step=step + 1)
        # checkpoint: the step's end; `marsi eval` loads these
        coord.checkpoint(step=step + 1)
    bar.close()
    print("run dir:", coord.log.dir, " reward_ema:", round(coord.loop_state.get("reward_ema", 0.0), 4))
