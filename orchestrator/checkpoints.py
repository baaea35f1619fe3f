"""Checkpoints of a run: the coordinator state the next step depends on, saved with every trainer's files
(`save`, `checkpoint`), loaded back (`restore`, `load_weights`), and the recovery from a dead or hung trainer
(`recover`: restart every trainer, restore the last good checkpoint)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Callable, TypeVar

from agent_trainer.agent import Served
from agent_trainer.handle import PlacementError, TrainerFailure
from agent_trainer.storage import StorageError
from orchestrator import runstore
from orchestrator.advantages import saved_baselines
from orchestrator.checkpoint_files import (
    CheckpointName, agent_files, as_checkpoint, checkpoint_problem, read_checkpoint_state,
)
from orchestrator.console import say
from orchestrator.coordinator_state import CoordinatorState
from orchestrator.data import DataPosition
from orchestrator.pipeline import kept_rollouts
from orchestrator.runlog import RunDirError, RunLog, recorded_place
from orchestrator.schedule import Schedule
from orchestrator.session import Session
from protocols.config import ConfigError, RunConfig
from protocols.messages import LoadRequest, Location, SaveRequest

T = TypeVar("T")


class Checkpoints:
    """`state`: the coordinator's state now, what the next checkpoint saves; `restored_from`: the checkpoint the
    last restore loaded (None before one); `restarts`: trainer restarts so far (at most `train.max_restarts`)."""

    def __init__(self, config: RunConfig, session: Session, schedule: Schedule, members: list[str], lag: int,
                 max_turns: int | None):
        self.config, self.session, self.schedule, self.members = config, session, schedule, members
        self.lag, self.max_turns = lag, max_turns
        self.log: RunLog | None = session.log
        self.state = CoordinatorState()
        self.restored_from: Location | None = None
        self.restarts = 0

    def checkpoint(self, step: int | None = None) -> Location:
        """Save every trainer and the coordinator state (with `loop_state`) under checkpoints/step-N,
        atomically. Custom loops pass the `step` they reached; `run()` keeps its own count."""
        if self.log is None:
            raise ConfigError("checkpoint(): this coordinator has no run directory; give Coordinator(config, run_dir)")
        latest = self.log.latest_checkpoint()
        done = CheckpointName.of(latest).step if latest is not None else -1
        if step is None and self.state.step == done:
            raise ConfigError(f"checkpoint(): {latest.name} exists; pass the step your loop reached: "
                              "checkpoint(step=N)")
        if step is not None and step < done:
            raise ConfigError(f"checkpoint(step={step}): the newest checkpoint is {latest.name}; steps only go forward")
        try:
            json.dumps(self.state.loop_state)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"checkpoint(): loop_state must hold JSON values only ({exc})") from None
        if step is not None:
            self.state.step = step
        return self.save()

    def save(self) -> Location:
        """Each trainer writes its files into the store (`agent_trainer.storage.save`) and reports them with
        checksums and sizes; the coordinator commits the checkpoint once every reported file is there, with
        all of them in its manifest."""
        staging = self.log.staging_path(self.state.step)
        try:
            requests = {a: SaveRequest(target=staging / "agents" / a) for a in self.members}
            stored = self.session.pool.each(Served.save, requests)  # agents and critics: what every kind serves
            files = {f"agents/{a}/{name}": (digest, report.sizes[name])
                     for a, report in stored.items() for name, digest in report.files.items()}
            state = asdict(self.state)
            if self.log.storage is not None:  # the store alone holds the run: its records go with each checkpoint
                files.update(runstore.mirror(self.log, staging))
                state["records"] = runstore.append_records(self.log)  # the transcripts: what was appended
            committed = self.log.commit_checkpoint(staging, self.state.step, state, self.config.train.keep_checkpoints,
                                                   files=files)
        except BaseException as exc:
            full = self.log.disk_full(exc, checkpoint=True)
            problem = self.log.disk_problem(exc, checkpoint=True) if full else None  # measured before the cleanup frees space
            self.log.abort_checkpoint(staging)  # a half-written checkpoint only takes space
            if full:
                raise RunDirError(problem) from exc
            raise
        if self.log.storage is not None:
            with contextlib.suppress(OSError, StorageError):  # what is left now goes at the next commit
                runstore.prune_records(self.log)
        return committed

    def load_trainers(self, checkpoint: Location) -> str | None:
        """Every trainer loads its files of `checkpoint`, each checked against the manifest on its node first;
        why the checkpoint is damaged, or None once all have loaded."""
        self.session.untrained = False
        requests = {a: LoadRequest(source=checkpoint / "agents" / a, files=agent_files(checkpoint, a))
                    for a in self.members}
        problems = self.session.pool.each(Served.load, requests)
        return next((f"agents/{a}/{p}" for a, p in problems.items() if p), None)

    def load_weights(self, checkpoint: str | Path | Location) -> None:
        """Load every agent's weights from an intact checkpoint, leaving the coordinator's own state as it is."""
        checkpoint = as_checkpoint(checkpoint, self.config.train.storage_timeout_s)
        problem = checkpoint_problem(checkpoint) or self.load_trainers(checkpoint)
        if problem:
            raise FileNotFoundError(f"checkpoint {checkpoint} cannot be loaded: {problem}")

    def restore(self, path: str | Path | Location | None = None) -> Location:
        """Load every trainer and the coordinator state from `path` (a run-directory path or a storage URI);
        by default from the newest checkpoint that is intact, falling back to older ones (and saying so)
        when the newest is damaged (a missing, truncated or altered file). A trainer that dies or hangs while
        loading is a trainer failure (see `recover`), not damage."""
        if path is not None:
            candidates = [as_checkpoint(path, self.config.train.storage_timeout_s)]
        else:
            candidates = list(reversed(self.log.checkpoints()))
        if not candidates:
            raise FileNotFoundError(no_checkpoint(self.log))
        for i, candidate in enumerate(candidates):
            problem = checkpoint_problem(candidate) or runstore.reconcile(self.log, candidate)  # records: run/ in it
            if problem is None:
                problem = self.load_trainers(candidate)
            if problem is None:
                break
            if i + 1 == len(candidates):
                raise FileNotFoundError(f"checkpoint {candidate} cannot be loaded: {problem}; no older one is left")
            say(f"checkpoint {candidate.name} is damaged ({problem}); falling back to {candidates[i + 1].name}")
        raw = read_checkpoint_state(candidate)
        self.state = CoordinatorState(step=raw["step"], episodes=raw["episodes"], data=DataPosition(**raw["data"]),
                                      baselines=saved_baselines(raw["baselines"], self.max_turns), loop_state=raw.get("loop_state", {}))
        self.state.versions = raw.get("versions") or {a: self.schedule.updates(a, raw["step"]) for a in self.config.agents}
        self.state.rollouts, replay = kept_rollouts(raw.get("rollouts", []), raw["step"], self.lag)
        if replay is not None:  # played further ahead than this run's lag: drawn and played again
            self.state.data, self.state.episodes = DataPosition(**replay["data_before"]), replay["episodes_before"]
        self.log.truncate_after(self.state.step)
        self.restored_from = candidate
        return candidate

    def resume(self) -> None:
        """A resumed run's start: restore the newest intact checkpoint into the started trainers (unless a restart
        while starting restored it already), then write the run's config, overrides included."""
        if self.restored_from is None:
            try:
                self.restore()
            except TrainerFailure as failure:
                self.recover(failure)
        self.log.write_config(self.config)

    def recover(self, failure: TrainerFailure) -> None:
        """Restart every trainer and restore the last good checkpoint (before the run's first checkpoint:
        start afresh); a failure while doing so spends another restart. Raise when that cannot help."""
        limit = self.config.train.max_restarts
        while True:
            if not failure.recoverable:
                raise failure
            self.restarts += 1
            last = self.log.latest_checkpoint() if self.log is not None else None
            fresh = last is None and self.log is not None and self.state == CoordinatorState()
            if self.restarts > limit or (last is None and not fresh):
                why = f"after {limit} restarts" if self.restarts > limit else "and there is no checkpoint to restart from"
                hint = f"; once the cause is fixed, continue with: marsi resume {self.log.dir}" if last else ""
                raise RunFailed(f"{failure}; stopping {why}; last good checkpoint: {last}{hint}") from failure
            say(f"{failure}; restarting the trainers from {last.name if last else 'their initial weights'} "
                f"(restart {self.restarts} of {limit})")
            try:
                self.session.pool.close()
                try:
                    self.session.pool = self.session.start_trainers()
                except PlacementError as exc:  # the cluster cannot hold the trainers now (a node lost, ...)
                    hint = f"; once it can, continue with: marsi resume {self.log.dir}" if last is not None else ""
                    raise RunFailed(f"{failure}; the trainers could not be restarted: {exc}; last good checkpoint: "
                                    f"{last}{hint}") from exc
                self.session.check_storage_reach()  # restarted trainers may sit on other nodes
                if last is not None:
                    self.restore()
                return
            except TrainerFailure as again:
                failure = again

    def with_recovery(self, fn: Callable[[], T]) -> T:
        """`fn()`, recovering from each trainer failure (`recover`) and calling it again, until it returns."""
        while True:
            try:
                return fn()
            except TrainerFailure as failure:
                self.recover(failure)


def no_checkpoint(log: RunLog) -> str:
    """Why a run cannot be resumed: no complete checkpoint where its checkpoints go (named, since with
    train.storage that is not the run directory)."""
    where = "" if log.storage is None else f" in {log.checkpoint_dir()}"
    renamed = "" if log.storage is None or recorded_place(log.dir) is not None else (
        "; the run's place in storage is named after its run directory when it began, so a renamed run directory "
        "looks under its new name: resume the place itself, marsi resume STORAGE/RUN_NAME")
    return f"{log.dir}: no complete checkpoint to resume from{where}; start the run anew with marsi run{renamed}"


class RunFailed(RuntimeError):
    """The run stopped: a trainer kept failing or could not be restarted; names the last good checkpoint."""
