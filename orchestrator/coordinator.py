"""Coordinator: starts one trainer per agent, plays episodes, scores them, and trains on the schedule.

Its primitives (`generate`, `train`, `checkpoint`, `restore`) serve custom coordinator scripts;
`run()` is the standard loop built from them.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agent_trainer.group import LocalTrainers, TrainerFailure
from orchestrator import rollout
from orchestrator.advantages import experiences_by_agent
from orchestrator.data import DataPosition, load_samples, next_batch
from orchestrator.runlog import CHECKPOINT_DONE, RunLog, checkpoint_problem
from orchestrator.schedule import RoleAssignment, Schedule
from protocols.config import RunConfig, load_config
from protocols.imports import import_object
from protocols.messages import (
    Completion, Experience, GenerateRequest, Prompt, UpdateRequest, UpdateResult, check_experiences,
)


@dataclass
class CoordinatorState:
    """Everything of the coordinator's that the next step depends on (the trainers hold the rest)."""

    step: int = 0
    """Steps completed."""
    episodes: int = 0
    """Episodes played: the next episode's index, which per-episode role rotation follows."""
    data: DataPosition = field(default_factory=DataPosition)
    baselines: dict[str, dict[str, float]] = field(default_factory=dict)
    """EMA return baseline per agent, then per role (algorithm.baseline == "ema")."""


class Coordinator:
    """`with Coordinator(config, run_dir) as coord: coord.run()`."""

    def __init__(self, config: RunConfig, run_dir: str | Path | None = None):
        self.config = config
        self.schedule = Schedule(config.schedule, list(config.agents))
        self.assignment = RoleAssignment(config.roles)
        self.env_cls = import_object(config.environment.name)
        self.samples = load_samples(config.data)
        self.state = CoordinatorState()
        self.log = RunLog(run_dir, config.logging) if run_dir is not None else None
        self.trainers = None
        self.restarts = 0
        self.stop_requested = False
        self._owns_ray = False
        self._seconds = defaultdict(float)
        self._warned: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------------------ start / stop
    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the trainers (and Ray when enabled); a started coordinator stays as it is."""
        if self.trainers is not None:
            return
        if self.config.ray.enabled:
            from agent_trainer.actor import init_ray

            self._owns_ray = init_ray(self.config.ray)
        self.trainers = self._start_trainers()
        if self.log is not None:
            self.log.write_config(self.config)

    def _start_trainers(self):
        updates = {a: self.schedule.updates(a, self.config.train.steps) for a in self.config.agents}
        if self.config.ray.enabled:
            from agent_trainer.actor import RayTrainers

            return RayTrainers(self.config, updates)
        return LocalTrainers(self.config, updates)

    def close(self) -> None:
        if self.trainers is not None:
            self.trainers.close()
            self.trainers = None
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

    @classmethod
    def resume(cls, run_dir: str | Path, overrides: list[str] | None = None) -> Coordinator:
        """A started coordinator for `run_dir`, restored from its newest complete checkpoint.
        `overrides` (dotted.key=value) change the stored config, e.g. `train.steps=200` to extend a run."""
        config = load_config(Path(run_dir) / "config.yaml", overrides)
        coord = cls(config, run_dir)
        coord.start()
        coord.restore()
        return coord

    # -------------------------------------------------------------------------------- primitives
    def generate(self, prompts: dict[str, list[Prompt]], seed: int) -> dict[str, list[Completion]]:
        """Completions for each agent's prompts: one request per agent, all agents at once."""
        start = time.perf_counter()
        requests = {a: {"request": GenerateRequest(prompts=p, seed=rollout.derive_seed(seed, a))}
                    for a, p in prompts.items() if p}
        results = self.trainers.call("generate", requests, timeout=self.config.train.call_timeout_s)
        self._seconds["generate"] += time.perf_counter() - start
        return {a: r.completions for a, r in results.items()}

    def train(self, experiences: dict[str, list[Experience]]) -> dict[str, UpdateResult]:
        """Update each named agent on its experiences now, all agents at once. Every experience is checked
        first: a non-finite advantage or log-prob stops the call before any agent trains."""
        for agent, exps in experiences.items():
            check_experiences(agent, exps)
        start = time.perf_counter()
        requests = {a: {"request": UpdateRequest(experiences=e)} for a, e in experiences.items() if e}
        results = self.trainers.call("update", requests, timeout=self.config.train.call_timeout_s)
        self._seconds["update"] += time.perf_counter() - start
        for agent, result in results.items():
            if result.skipped_steps:
                self.warn_once(agent, "nonfinite", f"agent {agent!r}: an update's loss or gradient was not finite at "
                               f"update {result.step}; that optimizer step was skipped (counted in skipped_steps/{agent})")
        return results

    def warn_once(self, agent: str, kind: str, message: str) -> None:
        if (agent, kind) not in self._warned:
            self._warned.add((agent, kind))
            say(message)

    def play(self, samples: list[dict[str, Any]]) -> list[rollout.Episode]:
        """`num_generations` episodes per sample, with the configured role assignment."""
        kwargs = self.config.environment.kwargs
        episodes = rollout.play(lambda: self.env_cls(**kwargs), samples, self.config.train.num_generations,
                                self.assignment, self.generate, seed=self.config.train.seed,
                                first_episode=self.state.episodes)
        self.state.episodes += len(episodes)
        return episodes

    def checkpoint(self, step: int | None = None) -> Path:
        """Save every trainer and the coordinator state under checkpoints/step-N, atomically.
        Custom loops pass the `step` they reached; `run()` keeps its own count."""
        if step is not None:
            self.state.step = step
        staging = self.log.staging_path(self.state.step)
        self.trainers.call("save", {a: {"path": str(staging / "agents" / a)} for a in self.config.agents})
        state = {**asdict(self.state), "schedule_phase": self.schedule.phase(self.state.step)}
        return self.log.commit_checkpoint(staging, self.state.step, state, self.config.train.keep_checkpoints)

    def restore(self, path: str | Path | None = None) -> Path:
        """Load every trainer and the coordinator state from `path`; by default from the newest
        checkpoint that is intact, falling back to older ones (and saying so) when the newest is damaged."""
        candidates = [Path(path)] if path is not None else list(reversed(self.log.checkpoints()))
        if not candidates:
            raise FileNotFoundError(f"{self.log.dir}: no complete checkpoint to resume from; start the run anew with marsi run")
        for i, candidate in enumerate(candidates):
            problem = checkpoint_problem(candidate)
            if problem is None:
                try:
                    self.trainers.call("load", {a: {"path": str(candidate / "agents" / a)} for a in self.config.agents})
                    break
                except TrainerFailure as failure:
                    problem = str(failure)
            if i + 1 == len(candidates):
                raise FileNotFoundError(f"checkpoint {candidate} cannot be loaded: {problem}; no older one is left")
            say(f"checkpoint {candidate.name} is damaged ({problem}); falling back to {candidates[i + 1].name}")
        raw = json.loads((candidate / CHECKPOINT_DONE).read_text())
        if not all(isinstance(v, dict) for v in raw["baselines"].values()):
            raise ValueError(f"checkpoint {candidate} keeps EMA baselines per role (an older format); they are now kept "
                             "per agent and role: start the run anew")
        self.state = CoordinatorState(step=raw["step"], episodes=raw["episodes"], data=DataPosition(**raw["data"]),
                                      baselines=raw["baselines"])
        self.log.truncate_after(self.state.step)
        return candidate

    def recover(self, failure: TrainerFailure) -> None:
        """Restart every trainer and restore the last good checkpoint; raise when that cannot help."""
        if not failure.recoverable:
            raise failure
        self.restarts += 1
        limit = self.config.train.max_restarts
        last = self.log.latest_checkpoint() if self.log is not None else None
        if self.restarts > limit or last is None:
            why = f"after {limit} restarts" if last is not None else "and there is no checkpoint to restart from"
            raise RunFailed(f"{failure}; stopping {why}; last good checkpoint: {last}") from failure
        say(f"{failure}; restarting the trainers from {last.name} (restart {self.restarts} of {limit})")
        self.trainers.close()
        self.trainers = self._start_trainers()
        self.restore()

    def request_stop(self) -> None:
        """Stop at the next safe point (after the current step), with a checkpoint."""
        self.stop_requested = True

    def parameters_digests(self) -> dict[str, str]:
        return self.trainers.call("parameters_digest", {a: {} for a in self.config.agents})

    # -------------------------------------------------------------------------------------- run
    def run(self, until: int | None = None) -> list[dict[str, Any]]:
        """Train until `until` steps are done (default `train.steps`) or a stop is requested; returns
        the metrics of the steps run here. A dead or hung trainer is restarted from the last checkpoint."""
        cfg = self.config.train
        until = cfg.steps if until is None else min(until, cfg.steps)
        if self.log is not None and self.log.latest_checkpoint() is None:
            self.checkpoint()  # step 0: something to restart from
        bar = _progress(self.state.step, until, cfg.progress)
        history, failed_at = [], None
        while self.state.step < until and not self.stop_requested:
            self._seconds.clear()
            start = time.perf_counter()
            try:
                # rollout
                samples = next_batch(self.samples, cfg.batch_size, self.state.data, cfg.seed, self.config.data.shuffle)
                episodes = self.play(samples)
                # advantages
                experiences = experiences_by_agent(episodes, self.config.algorithm, self.state.baselines)
                # update: the scheduled agents only; the others' experiences are dropped (on-policy)
                scheduled = self.schedule.training_agents(self.state.step)
                training = [a for a in scheduled if a in experiences]
                results = self.train({a: experiences[a] for a in training})
                self.state.step += 1
                # log
                metrics = step_metrics(self.state.step, episodes, results, self._seconds, time.perf_counter() - start)
                for agent in sorted(set(scheduled) - set(training)):
                    metrics[f"no_experiences/{agent}"] = 1
                    self.warn_once(agent, "idle", f"agent {agent!r} is scheduled to train but got no experiences at "
                                   f"step {self.state.step} (no role it holds was prompted); its update is skipped "
                                   f"(counted in no_experiences/{agent})")
                if failed_at is not None:
                    metrics["time/recovery"], failed_at = time.perf_counter() - failed_at, None
                if self.log is not None:
                    self.log.log_metrics(metrics)
                    self.log.log_transcripts(self.state.step, [e.transcript() for e in episodes[:cfg.transcripts_per_step]])
                # checkpoint
                every = cfg.checkpoint_every
                at_end = self.state.step == cfg.steps or self.stop_requested
                if self.log is not None and ((every and self.state.step % every == 0) or at_end):
                    self.checkpoint()
            except TrainerFailure as failure:
                failed_at = time.perf_counter()
                self.recover(failure)  # back to the last checkpoint; its later steps are replayed
                history = [m for m in history if m["step"] <= self.state.step]
                bar.reset(until)
                bar.update(self.state.step)
                continue
            history.append(metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", training=",".join(training) or "-")
        bar.close()
        return history


class RunFailed(RuntimeError):
    """The run stopped: a trainer kept failing or could not be restarted; names the last good checkpoint."""


def say(message: str) -> None:
    print(f"marsi: {message}", file=sys.stderr, flush=True)


def step_metrics(step: int, episodes: list[rollout.Episode], results: dict[str, UpdateResult],
                 seconds: dict[str, float], step_seconds: float) -> dict[str, Any]:
    totals = [e.total_reward() for e in episodes]
    shared = [statistics.fmean(t.values()) if isinstance(t, dict) else t for t in totals]
    metrics: dict[str, Any] = {
        "step": step, "trained": sorted(results),
        "reward/mean": statistics.fmean(shared), "reward/std": statistics.pstdev(shared),
    }
    for role in sorted({r for t in totals if isinstance(t, dict) for r in t}):
        metrics[f"reward/{role}"] = statistics.fmean(t[role] for t in totals)
    lengths, invalid, actions = defaultdict(list), 0, 0
    for e in episodes:
        for turn in e.turns:
            for a in turn.actions:
                lengths[a.agent].append(len(a.completion.completion_ids))
                actions += 1
                invalid += bool(turn.infos.get(a.role, {}).get("invalid"))
    for agent, values in sorted(lengths.items()):
        metrics[f"completion_length/{agent}"] = statistics.fmean(values)
    metrics["turns/mean"] = statistics.fmean(len(e.turns) for e in episodes)
    metrics["invalid_rate"] = invalid / max(1, actions)
    for key in sorted({k for e in episodes for k in e.info}):
        values = [float(e.info[key]) for e in episodes if key in e.info]
        metrics[f"episode/{key}"] = statistics.fmean(values)
    for agent, r in sorted(results.items()):
        for name in ("loss", "kl", "grad_norm", "entropy", "clip_fraction", "lr", "skipped_steps"):
            metrics[f"{name}/{agent}"] = getattr(r, name)
        if r.logp_mismatch is not None:
            metrics[f"logp_mismatch/{agent}"] = r.logp_mismatch
            metrics[f"rollout/logp_gap/{agent}"] = r.logp_mismatch
            metrics[f"rollout/logp_gap_max/{agent}"] = r.logp_gap_max
        if r.tis_weight is not None:
            metrics[f"rollout/tis_weight/{agent}"] = r.tis_weight
            metrics[f"rollout/tis_truncated/{agent}"] = r.tis_truncated
        metrics[f"tokens/{agent}"] = r.num_tokens
        metrics[f"time/sync/{agent}"] = r.sync_seconds
    generate_s, update_s = seconds.get("generate", 0.0), seconds.get("update", 0.0)
    metrics.update({"time/step": step_seconds, "time/generate": generate_s, "time/update": update_s,
                    "time/coordinator": step_seconds - generate_s - update_s, "time/end": time.time()})
    return metrics


def _progress(done: int, total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, disable=not enabled, unit="step", dynamic_ncols=True)
