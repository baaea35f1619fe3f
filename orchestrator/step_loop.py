"""The standard step loop, `Coordinator.run()`: rollout, advantages, update, log, evaluate, checkpoint, built from
the coordinator's primitives as a custom loop would be. A dead or hung trainer is recovered from the last
checkpoint (`Checkpoints.recover`) and the steps after it are replayed."""

from __future__ import annotations

import time
from typing import Any, Protocol

from agent_trainer.handle import TrainerFailure
from orchestrator.checkpoints import Checkpoints
from orchestrator.console import phase, progress
from orchestrator.evaluation import Evaluation
from orchestrator.memory_plan import MemoryPlan
from orchestrator.pipeline import AsyncRollouts, SyncRollouts
from orchestrator.rollout import Episode
from orchestrator.rollout_source import RolloutSource
from orchestrator.runlog import RunDirError, RunLog
from orchestrator.schedule import Schedule
from orchestrator.steplog import critic_metrics, show_step, step_memory, step_metrics, zero_variance_metrics
from protocols.messages import CriticUpdateResult, Experience, UpdateResult, ValueTarget


class Primitives(RolloutSource, Protocol):
    """What the loop uses of the coordinator (`Coordinator` is one): its parts, the primitives, and `seconds`, the
    time the primitives spent in the current step by kind (generate, update, critic), which the loop clears."""

    schedule: Schedule
    log: RunLog | None
    evaluation: Evaluation | None
    checkpoints: Checkpoints
    memory: MemoryPlan
    members: list[str]
    lag: int
    lag_note: str | None
    seconds: dict[str, float]
    stop_requested: bool

    def advantages(self, episodes: list[Episode]
                   ) -> tuple[dict[str, list[Experience]], dict[str, list[ValueTarget]]]: ...

    def train(self, experiences: dict[str, list[Experience]]) -> dict[str, UpdateResult]: ...

    def train_critics(self, targets: dict[str, list[ValueTarget]]) -> dict[str, CriticUpdateResult]: ...

    def recover(self, failure: TrainerFailure) -> None: ...

    def log_step(self, metrics: dict[str, Any], episodes: list[Episode]) -> None: ...

    def evaluate(self, step: int | None = None) -> dict[str, float]: ...


class StepLoop:
    """Runs `coord`'s steps until `until` are done or a stop is requested."""

    def __init__(self, coord: Primitives, until: int):
        self.coord, self.until = coord, until
        self.failed_at: float | None = None  # when the last trainer failure was caught, until a step logs it
        self.unsaved = False  # a step was logged after the newest checkpoint

    def run(self) -> list[dict[str, Any]]:
        """The metrics of the steps run here (those a recovery replays, once)."""
        coord, cfg = self.coord, self.coord.config.train
        self.begin()
        bar = progress(coord.state.step, self.until, cfg.progress)
        history, rollouts = [], self.rollouts()
        try:  # the bar is closed whatever happens, so an error starts a line of its own
            while coord.state.step < self.until and not coord.stop_requested:
                try:
                    metrics = self.step(rollouts)
                except OSError as exc:  # a full or read-only disk under the run directory
                    if coord.log is None:
                        raise
                    raise RunDirError(coord.log.disk_problem(exc)) from exc
                except TrainerFailure as failure:
                    self.failed_at = time.perf_counter()
                    rollouts.close()
                    coord.recover(failure)  # back to the last checkpoint; its later steps are replayed
                    self.unsaved = False
                    coord.checkpoints.with_recovery(lambda: coord.memory.prepare(coord.pool, coord.state.step, start=True))
                    rollouts = self.rollouts()
                    history = [m for m in history if m["step"] <= coord.state.step]
                    bar.reset(self.until)
                    bar.update(coord.state.step)
                    continue
                history.append(metrics)
                show_step(bar, metrics)
            if coord.stop_requested and self.unsaved:  # asked after this step's checkpoint was decided against
                self.save(rollouts)
            rollouts.hand_over()  # what a later run() or checkpoint continues from
        finally:
            rollouts.close()
            bar.close()
        return history

    def step(self, rollouts: SyncRollouts | AsyncRollouts) -> dict[str, Any]:
        """One step, its metrics row logged; returns the row."""
        coord, state, cfg = self.coord, self.coord.state, self.coord.config.train
        coord.seconds.clear()
        start = time.perf_counter()
        # rollout: played now, or ahead while earlier steps updated (train.max_staleness)
        step = state.step
        episodes, position = rollouts.take(step)
        # advantages
        experiences, value_targets = coord.advantages(episodes)
        # update: the scheduled agents only, on the actions fresh enough (the others' are dropped); critics every step
        scheduled = coord.schedule.training_agents(step)
        usable, staleness = rollouts.usable(step, episodes, {a: experiences[a] for a in scheduled if a in experiences},
                                            scheduled)
        training = [a for a in scheduled if a in usable]
        rollouts.updating(step, training)
        results = coord.train({a: usable[a] for a in training})
        state.versions.update({a: r.policy_version for a, r in results.items()})
        coord.memory.prepare(coord.pool, step + 1)  # optimizer state: released until its next update, fetched before
        rollouts.updated(step, training)
        critic_results = coord.train_critics(value_targets)
        memory = step_memory(coord.pool, coord.members, step)  # each process's peak memory in this step
        state.step += 1
        # log
        metrics = step_metrics(state.step, episodes, results, coord.seconds, time.perf_counter() - start)
        metrics.update(critic_metrics(critic_results, coord.seconds))
        metrics.update(memory)
        metrics.update(staleness)
        metrics.update(rollouts.metrics((start, time.perf_counter())))
        metrics["data/epoch"] = position.epoch + position.index / len(coord.samples)
        metrics.update(zero_variance_metrics(episodes, coord.config.algorithm))
        metrics.update(self.idle(sorted(set(scheduled) - set(training) - set(experiences))))
        if self.failed_at is not None:
            metrics["time/recovery"], self.failed_at = time.perf_counter() - self.failed_at, None
        coord.log_step(metrics, episodes)
        self.unsaved = coord.log is not None
        # evaluate (before the checkpoint: a kill during it replays the step and the evaluation)
        if coord.evaluation is not None and coord.evaluation.due(state.step):
            rollouts.settle(state.step)
            coord.evaluate()
        # checkpoint
        every, at_end = cfg.checkpoint_every, state.step == cfg.steps or coord.stop_requested
        if coord.log is not None and ((every and state.step % every == 0) or at_end):
            self.save(rollouts)
        return metrics

    def save(self, rollouts: SyncRollouts | AsyncRollouts) -> None:
        """A checkpoint of the step just done, with the rollouts played ahead of it."""
        rollouts.hand_over()
        self.coord.checkpoints.save()
        self.unsaved = False

    def begin(self) -> None:
        """Before the first step: a checkpoint to restart from (step 0), the evaluation due at the current step
        unless the run's records hold it (one a kill cut short), and the note on the rollouts' lag."""
        coord = self.coord
        if coord.log is not None and coord.log.latest_checkpoint() is None:
            coord.checkpoints.with_recovery(coord.checkpoints.save)  # step 0: something to restart from
        if coord.evaluation is not None and coord.evaluation.due(coord.state.step) and not self.evaluated():
            began = time.perf_counter()
            row = coord.checkpoints.with_recovery(coord.evaluate)
            phase(f"evaluation at step {coord.state.step}: eval/reward/mean {row['eval/reward/mean']:.3f}",
                  time.perf_counter() - began)
        if coord.lag_note:
            coord.warn_once("rollouts", "lag", coord.lag_note)
        coord.checkpoints.with_recovery(lambda: coord.memory.prepare(coord.pool, coord.state.step, start=True))

    def evaluated(self) -> bool:
        """Whether the run's records already hold an evaluation of the current step."""
        log = self.coord.log
        return log is not None and any(r["step"] == self.coord.state.step and "eval/reward/mean" in r
                                       for r in log.metrics())

    def idle(self, agents: list[str]) -> dict[str, int]:
        """Scheduled agents that got no experiences this step: counted in the row, and said once each."""
        for agent in agents:
            self.coord.warn_once(agent, "idle", f"agent {agent!r} is scheduled to train but got no experiences at "
                                 f"step {self.coord.state.step} (no role it holds was prompted); its update is skipped "
                                 f"(counted in no_experiences/{agent})")
        return {f"no_experiences/{agent}": 1 for agent in agents}

    def rollouts(self) -> SyncRollouts | AsyncRollouts:
        """Where the steps' episodes come from: played at each step, or `coord.lag` steps ahead."""
        return AsyncRollouts(self.coord, self.coord.lag) if self.coord.lag else SyncRollouts(self.coord)
