"""What a step logs, for `Coordinator.run()` and a custom loop alike: the parts of its metrics row, which of its
episodes are kept whole as transcripts (the episodes `marsi report` browses), and its progress line.

- `episode_metrics(episodes)`: `reward/mean|std|min|max`, `reward/ROLE` (games that pay each role its own reward),
  `completion_length/AGENT`, `turns/mean`, `invalid_rate` (the share of actions whose info says
  `{"invalid": True}`: `Turn.info_of`), `episode/KEY` for each `episode_info` entry;
- `update_metrics(results)`: per agent updated, `loss/`, `kl/`, `grad_norm/`, `entropy/`, `clip_fraction/`,
  `lr/`, `skipped_steps/`, the log-prob gap and truncated importance weights where measured, `tokens/`,
  `time/sync/` and `time/learn/`;
- `zero_variance_metrics(episodes, algorithm)`: `groups/zero_variance/AGENT`, the share of an agent's groups whose
  returns are all equal (no gradient under group baselines);
- `critic_metrics(results, seconds)`: per critic its value loss, clip fraction, explained variance, grad norm;
- `step_memory(pool, members, step)`: `memory/peak_mib/AGENT`, the peak resident memory of each agent's
  processes during the step (agents and critics that share a process as one key, `memory/peak_mib/a+b`), and
  `memory/device_peak_mib/AGENT` on a GPU (`memory_metrics` of the readings);
- `spread(episodes, n)`: the n episodes kept as transcripts, spread over the step's samples (one of each sample's
  group in turn), not the first sample's group alone;
- `loop_episode(...)`: an `Episode` made of a custom loop's own turns, which every helper here takes;
- `show_step(bar, metrics)`: the progress line's end of a step (`orchestrator.console.progress` makes the bar).

`Coordinator.log_step(metrics, episodes)` writes a row and the kept transcripts to the run's records.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from typing import Any

from agent_trainer.agent import Served
from agent_trainer.handle import TrainerPool
from orchestrator.advantages import zero_variance_shares
from orchestrator.rollout import Episode, RecordedRoles, Turn
from protocols.config import AlgorithmConfig
from protocols.messages import CriticUpdateResult, MemoryReading, UpdateResult

MEASURED = ("time/", "memory/")
"""Prefixes of the keys a step measures (seconds, memory) rather than computes: two identical runs differ in these
alone (`computed`)."""


def computed(row: dict[str, Any]) -> dict[str, Any]:
    """`row` without its measured keys (`MEASURED`): what a rerun, a resumed run or a run on another engine with
    the same seeds must repeat exactly."""
    return {k: v for k, v in row.items() if not k.startswith(MEASURED)}


UPDATE_FIELDS = ("loss", "kl", "grad_norm", "entropy", "clip_fraction", "lr", "skipped_steps")
"""What `update_metrics` logs of each agent's `UpdateResult`, as `NAME/AGENT`, before the optional figures."""


def episode_metrics(episodes: list[Episode]) -> dict[str, Any]:
    """The rewards, completion lengths, turns, invalid rate and episode_info means of a step's episodes."""
    totals = [e.total_reward() for e in episodes]
    shared = [statistics.fmean(t.values()) if isinstance(t, dict) else t for t in totals]
    metrics: dict[str, Any] = {
        "reward/mean": statistics.fmean(shared), "reward/std": statistics.pstdev(shared),
        "reward/min": min(shared), "reward/max": max(shared),  # the bounds plots clip the +-std band to
    }
    for role in sorted({r for t in totals if isinstance(t, dict) for r in t}):
        metrics[f"reward/{role}"] = statistics.fmean(t[role] for t in totals)
    lengths, invalid, actions = defaultdict(list), 0, 0
    for e in episodes:
        for turn in e.turns:
            for a in turn.actions:
                lengths[a.agent].append(len(a.completion.completion_ids))
                actions += 1
                invalid += bool(turn.info_of(a).get("invalid"))
    for agent, values in sorted(lengths.items()):
        metrics[f"completion_length/{agent}"] = statistics.fmean(values)
    metrics["turns/mean"] = statistics.fmean(len(e.turns) for e in episodes)
    metrics["invalid_rate"] = invalid / max(1, actions)
    for key in sorted({k for e in episodes for k in e.info}):
        values = [float(e.info[key]) for e in episodes if key in e.info]
        metrics[f"episode/{key}"] = statistics.fmean(values)
    return metrics


def update_metrics(results: dict[str, UpdateResult]) -> dict[str, Any]:
    """Each updated agent's update statistics, as `NAME/AGENT`."""
    metrics: dict[str, Any] = {}
    for agent, r in sorted(results.items()):
        for name in UPDATE_FIELDS:
            metrics[f"{name}/{agent}"] = getattr(r, name)
        if r.logp_mismatch is not None:
            metrics[f"rollout/logp_gap/{agent}"] = r.logp_mismatch
            metrics[f"rollout/logp_gap_max/{agent}"] = r.logp_gap_max
        if r.tis_weight is not None:
            metrics[f"rollout/tis_weight/{agent}"] = r.tis_weight
            metrics[f"rollout/tis_truncated/{agent}"] = r.tis_truncated
        metrics[f"tokens/{agent}"] = r.num_tokens
        metrics[f"time/sync/{agent}"] = r.sync_seconds
        metrics[f"time/learn/{agent}"] = r.seconds - r.sync_seconds  # the learner's own share of the update
    return metrics


def zero_variance_metrics(episodes: list[Episode], algorithm: AlgorithmConfig) -> dict[str, float]:
    """`groups/zero_variance/AGENT`: per agent, the share of its groups (`algorithm.group_by`) whose returns are all
    equal. A share rising while the reward stays flat is a stall."""
    return {f"groups/zero_variance/{agent}": share for agent, share in zero_variance_shares(episodes, algorithm).items()}


def critic_metrics(results: dict[str, CriticUpdateResult], seconds: dict[str, float]) -> dict[str, Any]:
    """Per critic: its value loss, clip fraction, explained variance (before its update), gradient norm; and
    the seconds the critics took (values and updates)."""
    metrics: dict[str, Any] = {}
    for critic, r in sorted(results.items()):
        for name in ("value_loss", "value_clip_fraction", "explained_variance", "grad_norm", "skipped_steps"):
            metrics[f"critic/{name}/{critic}"] = getattr(r, name)
    if results:
        metrics["time/critic"] = seconds.get("critic", 0.0)
    return metrics


def step_memory(pool: TrainerPool, members: list[str], step: int) -> dict[str, float]:
    """Read each member's processes' peak memory since the reading before (`Served.memory`; `step`: the step,
    0-based, whose peak it is) and make its metrics (`memory_metrics`). Run once per step, after its updates."""
    return memory_metrics(pool.each(Served.memory, {m: step for m in members}))


def memory_metrics(readings: dict[str, MemoryReading]) -> dict[str, float]:
    """`memory/peak_mib/MEMBERS` per process group read (`agent_trainer.Served.memory`): the members (agents,
    critics) that answered from the same processes are one key, their names joined by `+` in the order given."""
    shared: dict[tuple[int, ...], list[str]] = {}
    for member, r in readings.items():
        shared.setdefault(tuple(r.processes), []).append(member)
    metrics: dict[str, float] = {}
    for members in shared.values():
        r, name = readings[members[0]], "+".join(members)
        metrics[f"memory/peak_mib/{name}"] = r.peak_bytes / 2**20
        if r.device_peak_bytes is not None:
            metrics[f"memory/device_peak_mib/{name}"] = r.device_peak_bytes / 2**20
    return metrics


def step_metrics(step: int, episodes: list[Episode], results: dict[str, UpdateResult],
                 seconds: dict[str, float], step_seconds: float) -> dict[str, Any]:
    """`run()`'s row of a step: its number (steps done), who trained, `episode_metrics`, `update_metrics` and the
    step's seconds (`time/step`, `/generate`, `/update`, `/coordinator`, `/end`)."""
    metrics: dict[str, Any] = {"step": step, "trained": sorted(results)}
    metrics.update(episode_metrics(episodes))
    metrics.update(update_metrics(results))
    generate_s, update_s = seconds.get("generate", 0.0), seconds.get("update", 0.0)
    metrics.update({"time/step": step_seconds, "time/generate": generate_s, "time/update": update_s,
                    "time/coordinator": step_seconds - generate_s - update_s - seconds.get("critic", 0.0),
                    "time/end": time.time()})
    return metrics


def spread(episodes: list[Episode], n: int) -> list[Episode]:
    """`n` of `episodes`, spread over their samples: the first episode of each sample's group, then the second of
    each, and so on; in the order they were played."""
    groups: dict[int, list[Episode]] = {}
    for e in episodes:
        groups.setdefault(e.sample_index, []).append(e)
    rounds = max((len(g) for g in groups.values()), default=0)
    picked = [g[i] for i in range(rounds) for g in groups.values() if i < len(g)][:n]
    played = {id(e): i for i, e in enumerate(episodes)}
    return sorted(picked, key=lambda e: played[id(e)])


def loop_episode(*, index: int, sample: int, roles: list[str], turns: list[Turn], terminated: bool = True,
                 truncated: bool = False, info: dict[str, Any] | None = None) -> Episode:
    """An ended episode of a custom loop's own turns: `index` numbers it in the run, `sample` is its group (the
    episodes played from one sample), `roles` every role of the game, each `Turn(actions, reward, infos)` holding
    `Action(role, agent, prompt, completion, advantage)`s. `infos[role] = {"invalid": True, "reason": ...}` counts
    in `invalid_rate` and shows in the report; `info` is the episode's `episode/KEY` metrics."""
    return Episode(index=index, sample_index=sample, env=RecordedRoles(roles), turns=list(turns),
                   terminated=terminated, truncated=truncated, info=dict(info or {}))


def show_step(bar, metrics: dict[str, Any]) -> None:
    """End a step on the progress bar (`orchestrator.console.progress`): the reward and the agents that trained."""
    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", training=",".join(metrics.get("trained", [])) or "-")
    bar.update(1)
