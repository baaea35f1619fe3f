"""Coordinator: starts one trainer per agent, plays episodes, scores them, and trains on the schedule.

Its primitives (`generate`, `train`, `checkpoint`, `restore`) serve custom coordinator scripts;
`run()` is the standard loop built from them.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from agent_trainer import storage
from agent_trainer.agent import Agent, Served
from agent_trainer.critic import Critic
from agent_trainer.handle import PlacementError, TrainerFailure, TrainerPool
from agent_trainer.precision import emulation_warning
from agent_trainer.storage import StorageError
from orchestrator import memory_plan, rollout, runstore
from orchestrator.advantages import Baselines, experiences_by_agent, saved_baselines
from orchestrator.baselines import uses_critic
from orchestrator.console import phase, progress
from orchestrator.credit import CriticCredit
from orchestrator.data import DataPosition, load_samples
from orchestrator.evaluation import EvalResult, Evaluation, partner_agents, partner_seats
from orchestrator.pipeline import AsyncRollouts, SyncRollouts, kept_rollouts
from orchestrator.preflight import check_environment
from orchestrator.runlog import (
    EVAL_TRANSCRIPTS, CheckpointName, RunDirError, RunLog, agent_files, as_checkpoint, checkpoint_problem,
    read_checkpoint_state, recorded_place,
)
from orchestrator.schedule import RoleAssignment, Schedule, attempts_problem, seating_problem
from orchestrator.staleness import planned_lag
from orchestrator.steplog import critic_metrics, show_step, spread, step_metrics, zero_variance_metrics
from protocols.config import ConfigError, RunConfig, critic_members, load_config
from protocols.errors import UserError
from protocols.messages import (
    Completion, CriticUpdateRequest, CriticUpdateResult, Experience, GenerateRequest, LoadRequest, Location,
    ProbeRequest, Prompt, SaveRequest, UpdateRequest, UpdateResult, ValueRequest, ValueTarget, check_experiences,
)


@dataclass
class CoordinatorState:
    """Everything of the coordinator's that the next step depends on (the trainers hold the rest)."""

    step: int = 0
    """Steps completed."""
    episodes: int = 0
    """Episodes played: the next episode's index, which per-episode role rotation follows."""
    data: DataPosition = field(default_factory=DataPosition)
    baselines: Baselines = field(default_factory=dict)
    """EMA return baseline per agent, role and turn (algorithm.baseline == "ema")."""
    loop_state: dict[str, Any] = field(default_factory=dict)
    """A custom loop's own state (JSON values), saved with each checkpoint and given back by restore."""
    versions: dict[str, int] = field(default_factory=dict)
    """Each agent's policy version (its updates so far); absent: 0."""
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    """Asynchronous rollouts (train.max_staleness > 0): the episodes of the steps after `step` already played with
    weights older than the checkpoint's (`pipeline.Played.record`); `data` and `episodes` stand after them."""


class Coordinator:
    """`with Coordinator(config, run_dir) as coord: coord.run()`. `run_dir` must hold no run yet (see
    `Coordinator.resume` to continue one); None keeps no records and no checkpoints.

    Attributes a custom loop reads: `step` (steps done), `restored_from` (the checkpoint `restore` loaded,
    or None), `loop_state` (its own JSON state, saved by `checkpoint` and given back by `restore`)."""

    def __init__(self, config: RunConfig, run_dir: str | Path | None = None, *, resume: bool = False,
                 take_over: bool = False):
        """`take_over`: take over the run's lease in its store from a run that is gone (`orchestrator.lease`)."""
        self.config = config
        self.resuming, self.take_over = resume, take_over
        storage.set_deadline(config.train.storage_timeout_s)  # every call to the store from this process
        self.schedule = Schedule(config.schedule, list(config.agents))
        self.lag, self.lag_note = planned_lag(config, self.schedule)
        """Steps the rollouts run ahead of the updates (0: synchronous), and why agents' own bounds lowered it
        (said once by `run()`); `orchestrator.staleness`."""
        self.assignment = RoleAssignment(config.roles)
        check_environment(config)  # kwargs its constructor lacks, partners it cannot seat: before Ray and trainers
        self.make_env = rollout.env_factory(config.environment.name, config.environment.kwargs)
        env = rollout.make_environment(self.make_env)  # a constructor that fails, fails here, before Ray and trainers
        self.max_turns = env.max_turns
        listed = rollout.attempts_of(env)  # the environment's own attempts
        problem = seating_problem(config.roles, env.possible_agents) or attempts_problem(config, listed)
        if problem:
            raise ConfigError(problem)
        self.attempts = rollout.attempts_of(env, config.roles.attempts)  # role -> k: who answers each prompt k times
        self.samples = load_samples(config.data)
        self.evaluation = Evaluation(config, self.samples, listed) if config.eval else None
        if self.evaluation and config.eval.environment_kwargs:
            rollout.make_environment(self.evaluation.make_env)  # its own kwargs: made once now, not at the first evaluation
        if self.evaluation and (warning := self.evaluation.greedy_copies()):
            say(warning)
        self.partners = partner_agents(config)  # extra frozen trainers that evaluations seat
        self.sits_in_for = partner_seats(config)  # partner trainer -> the agent whose seeds it samples with
        self.eval_results: list[tuple[int, EvalResult]] = []  # (step, result) of each evaluation run here, in order
        self.critics = critic_members(config)  # critic -> the agents it values (algorithm.baseline: critic)
        self.members = [*config.agents, *self.critics]  # what a checkpoint holds: every agent and critic
        self.credit = CriticCredit(config) if uses_critic(config.algorithm) else None  # chosen once
        self.state = CoordinatorState()
        self.log = RunLog(run_dir, config.logging, config.train.storage) if run_dir is not None else None
        self.pool: TrainerPool | None = None  # every agent's handle: self.pool[agent]
        self.restored_from: Location | None = None
        self.restarts = 0
        self.untrained = True  # every agent at its initial weights: no update and no load yet
        self.stop_requested = False
        self._owns_ray = False
        self.startup: dict[str, float] = {}  # seconds: Ray, the trainers, the slowest model load, all of start()
        self.precision: dict[str, dict[str, Any]] = {}  # per agent: dtype, reason, machine, slowdown (precision.Precision)
        self._seconds = defaultdict(float)
        self._warned: set[tuple[str, str]] = set()

    # ------------------------------------------------------------------------------ start / stop
    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Claim the run directory, start Ray when enabled and the trainers; a started coordinator stays
        as it is. A new run writes its config here; a resumed one once its checkpoint is restored."""
        if self.pool is not None:
            return
        if self.log is not None:
            self.log.claim(resume=self.resuming, take_over=self.take_over)
        began = time.perf_counter()
        try:
            if self.config.ray.enabled:
                from agent_trainer.actor import start_ray

                self._owns_ray = start_ray(self.config)
                phase("Ray started" if self._owns_ray else "joined Ray", time.perf_counter() - began)
            ray_up = time.perf_counter()
            self.pool = self._start_trainers()
            trainers_up = time.perf_counter()
            loaded = {a: max((w.get("load_s", 0.0) for w in i.get("workers", [i])), default=0.0)
                      for a, i in self.pool.start_info.items()}
            phase(f"{len(loaded)} trainer(s) up; model load " + ", ".join(f"{a} {s:.1f} s" for a, s in loaded.items()),
                  trainers_up - ray_up)
            self._with_recovery(self._check_storage_reach)
        except BaseException:
            if self.log is not None and not self.resuming:
                self.log.discard_unstarted()  # a new run that failed to start leaves no directory
            self.close()
            raise
        info = self.pool.start_info
        loads = [w.get("load_s", 0.0) for i in info.values() for w in i.get("workers", [i])]
        self.startup = {"ray_s": ray_up - began, "trainers_s": trainers_up - ray_up,
                        "model_load_s": max(loads, default=0.0), "total_s": time.perf_counter() - began}
        self.precision = {a: i["precision"] for a, i in info.items() if "precision" in i}
        self._say_precision()
        if self.log is not None and not self.resuming:
            self.log.write_config(self.config)
            self.log.snapshot_sources([self.config.environment.name, self.config.data.factory])

    def _say_precision(self) -> None:
        """The compute dtype each agent got and why, one line on stdout (stderr keeps errors to one line); an
        explicit bfloat16 that its device emulates gets one warning per machine on stderr, with the slowdown
        the trainer's probe measured there."""
        if not self.precision:
            return
        print("marsi: precision: " + "; ".join(f"{a} {p['dtype']} ({p['reason']})" for a, p in self.precision.items()),
              flush=True)
        emulated = defaultdict(list)
        for agent, p in self.precision.items():
            if p["slowdown"] is not None:
                emulated[p["machine"]].append((agent, p["slowdown"]))
        for machine, agents in emulated.items():
            say(emulation_warning([f"agents.{a}.dtype" for a, _ in agents], machine, max(s for _, s in agents)))

    def _start_trainers(self) -> TrainerPool:
        config = self.config
        if self.partners:  # partner trainers come last, so the agents' own seeds and indices stay as they are
            frozen = config.schedule.model_copy(update={"frozen": [*config.schedule.frozen, *self.partners]})
            config = config.model_copy(update={"agents": {**config.agents, **self.partners}, "schedule": frozen})
        updates = {a: self.schedule.updates(a, self.config.train.steps) if a in self.config.agents else 0
                   for a in config.agents}
        if config.ray.enabled:
            from agent_trainer.actor import RayTrainers

            return RayTrainers(config, updates)
        from agent_trainer.group import LocalTrainers

        return LocalTrainers(config, updates)

    def _check_storage_reach(self) -> None:
        """With Ray, trainers may run on other nodes: each must see where checkpoints go (the run directory,
        or train.storage). The coordinator writes a probe file among the run's checkpoints; each trainer reads it on its own node
        and, if it sees it, writes its answer beside it, which the coordinator must then see. A node that
        does not see the probe writes nothing, so a failed check leaves no file on any node."""
        if self.log is None or not self.config.ray.enabled:
            return
        agents, token = list(self.members), secrets.token_hex(8)
        where = self.log.checkpoint_dir()
        self.log.write_probe(token)
        try:
            seen = self.pool.each(Agent.probe, {a: ProbeRequest(where=where, token=token, agent=a) for a in agents})
            blind = [a for a in agents if not (seen[a] and self.log.probe_answered(token, a))]
        except TrainerFailure as failure:
            if failure.recoverable:
                raise
            node = self.pool.info()[failure.agent].get("node_label", "its node")
            store = f"train.storage {self.log.storage}" if self.log.storage else f"the run directory {self.log.dir}"
            raise StorageError(
                f"{store}: this coordinator reached it (it wrote {where}), but {node}, which hosts agent "
                f"{failure.agent!r}, did not ({failure.reason.removeprefix('StorageError: ')}); give that node the "
                "store's network and credentials (ray.forward_env passes variables such as AWS_ACCESS_KEY_ID from this "
                "shell to every trainer), or use a store every node reaches") from None
        finally:
            self.log.remove_probes(token, agents)
        if blind:
            agent = blind[0]
            node = self.pool.info()[agent].get("node_label", "its node")
            if self.log.storage is not None:
                raise StorageError(
                    f"train.storage {self.log.storage} is not the same storage on {node}, which hosts agent {agent!r} (a "
                    f"file this coordinator wrote to {where} is not visible there); give train.storage a URI or shared "
                    "path that every node reaches")
            raise StorageError(
                f"the run directory {self.log.dir} is not shared with {node}, which hosts agent {agent!r} (a file this "
                f"coordinator wrote there is not visible to it), so checkpoints would stay on that node; set "
                "train.storage to a URI every node reaches (s3://bucket/prefix, gs://..., hdfs://..., or file:// or a "
                "path on a shared filesystem), or put the run directory on a filesystem all nodes share")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False
        if self.log is not None:
            self.log.release()

    @classmethod
    def resume(cls, run_dir: str | Path, overrides: list[str] | None = None, *,
               fetch_to: str | Path | None = None, take_over: bool = False) -> Coordinator:
        """A started coordinator for `run_dir`, restored from its newest intact checkpoint.
        `overrides` (dotted.key=value) change the stored config, e.g. `train.steps=200` to extend a run;
        they are checked against the checkpoint first and written to config.yaml only once it is restored.
        `run_dir` may be the run's place in its store (`STORAGE/RUN_NAME`, a URI): the run directory is then
        fetched from there into `fetch_to` (new or empty; default `runstore.fetched_run_dir`) and the run goes on
        there; a run directory older than its store is brought up to it first (`runstore.resumable`)."""
        with runstore.resumable(run_dir, fetch_to, take_over=take_over) as (run_dir, _):
            config = load_config(run_dir / "config.yaml", overrides)
            check_resume(config, load_config(run_dir / "config.yaml", check_imports=False), RunLog(run_dir))
            coord = cls(config, run_dir, resume=True, take_over=take_over)  # its RunLog finds checkpoints where config.yaml says
            coord.start()
            try:
                if coord.restored_from is None:  # else a restart while starting restored it already
                    try:
                        coord.restore()
                    except TrainerFailure as failure:
                        coord.recover(failure)
                coord.log.write_config(config)
            except BaseException:
                coord.close()
                raise
        return coord

    @property
    def step(self) -> int:
        """Steps done: what `run()` counts, or what a custom loop last passed to `checkpoint(step=...)`."""
        return self.state.step

    @property
    def loop_state(self) -> dict[str, Any]:
        return self.state.loop_state

    @loop_state.setter
    def loop_state(self, value: dict[str, Any]) -> None:
        self.state.loop_state = value

    def _known(self, agents, action: str) -> None:
        for agent in agents:
            if agent not in self.config.agents and (action == "train" or agent not in self.partners):
                raise ConfigError(f"{action}: agent {agent!r} is not defined; defined agents: "
                                  f"{', '.join(self.config.agents)}")
            if action == "train" and agent in self.config.schedule.frozen:
                raise ConfigError(f"train: agent {agent!r} is frozen (schedule.frozen) and never updates; "
                                  "remove it from schedule.frozen to train it")

    # -------------------------------------------------------------------------------- primitives
    def generate(self, prompts: dict[str, list[Prompt]], seed: int,
                 temperature: float | None = None) -> dict[str, list[Completion]]:
        """Completions for each agent's prompts: one request per agent, all agents at once. `temperature`
        overrides the agents' own (0: greedy); completions carry the temperature they were drawn at."""
        self._known(prompts, "generate")
        start = time.perf_counter()
        requests = {a: GenerateRequest(prompts=p, seed=rollout.derive_seed(seed, self.sits_in_for.get(a, a)),
                                       temperature=temperature)
                    for a, p in prompts.items() if p}
        results = self.pool.each(Agent.generate, requests)
        self._seconds["generate"] += time.perf_counter() - start
        return {a: r.completions for a, r in results.items()}

    def train(self, experiences: dict[str, list[Experience]]) -> dict[str, UpdateResult]:
        """Update each named agent on its experiences now, all agents at once. Every experience is checked
        first: a non-finite advantage or log-prob stops the call before any agent trains."""
        self._known(experiences, "train")
        for agent, exps in experiences.items():
            check_experiences(agent, exps)
        start = time.perf_counter()
        requests = {a: UpdateRequest(experiences=e) for a, e in experiences.items() if e}
        self.untrained = self.untrained and not requests
        results = self.pool.each(Agent.update, requests)
        self._seconds["update"] += time.perf_counter() - start
        for agent, result in results.items():
            if result.skipped_steps:
                self.warn_once(agent, "nonfinite", f"agent {agent!r}: an update's loss or gradient was not finite at "
                               f"update {result.policy_version}; that optimizer step was skipped (counted in skipped_steps/{agent})")
        return results

    def values(self, states: dict[str, list[str]]) -> dict[str, list[float]]:
        """Each critic's values of its states (text), all critics at once."""
        start = time.perf_counter()
        requests = {c: ValueRequest(states=s) for c, s in states.items() if s}
        results = self.pool.each(Critic.values, requests)
        self._seconds["critic"] += time.perf_counter() - start
        return {c: results[c].values if c in results else [] for c in states}

    def train_critics(self, targets: dict[str, list[ValueTarget]]) -> dict[str, CriticUpdateResult]:
        """Update each named critic on its value targets now, all critics at once."""
        start = time.perf_counter()
        requests = {c: CriticUpdateRequest(targets=t) for c, t in targets.items() if t}
        results = self.pool.each(Critic.update, requests)
        self._seconds["critic"] += time.perf_counter() - start
        return results

    def advantages(self, episodes: list[rollout.Episode]
                   ) -> tuple[dict[str, list[Experience]], dict[str, list[ValueTarget]]]:
        """Each agent's experiences, and each critic's value targets (none without a critic): each agent's baseline
        strategy (`orchestrator.baselines`), or the critics' values and GAE (`orchestrator.credit`)."""
        if self.credit is not None:
            return self.credit.score(episodes, self.values)
        return experiences_by_agent(episodes, self.config.algorithm, self.state.baselines), {}

    def warn_once(self, agent: str, kind: str, message: str) -> None:
        if (agent, kind) not in self._warned:
            self._warned.add((agent, kind))
            say(message)

    def play(self, samples: list[dict[str, Any]]) -> list[rollout.Episode]:
        """`num_generations` episodes per sample, with the configured role assignment and attempts."""
        episodes = rollout.play(self.make_env, samples, self.config.train.num_generations,
                                self.assignment, self.generate, seed=self.config.train.seed,
                                first_episode=self.state.episodes, attempts=self.config.roles.attempts)
        self.state.episodes += len(episodes)
        return episodes

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
        return self._save_checkpoint()

    def _save_checkpoint(self) -> Location:
        """Each trainer writes its files into the store (`agent_trainer.storage.save`) and reports them with
        checksums and sizes; the coordinator commits the checkpoint once every reported file is there, with
        all of them in its manifest."""
        staging = self.log.staging_path(self.state.step)
        try:
            requests = {a: SaveRequest(target=staging / "agents" / a) for a in self.members}
            stored = self.pool.each(Served.save, requests)  # agents and critics: what every kind serves
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

    def _load_trainers(self, checkpoint: Location) -> str | None:
        """Every trainer loads its files of `checkpoint`, each checked against the manifest on its node first;
        why the checkpoint is damaged, or None once all have loaded."""
        self.untrained = False
        requests = {a: LoadRequest(source=checkpoint / "agents" / a, files=agent_files(checkpoint, a))
                    for a in self.members}
        problems = self.pool.each(Served.load, requests)
        return next((f"agents/{a}/{p}" for a, p in problems.items() if p), None)

    def restore(self, path: str | Path | Location | None = None) -> Location:
        """Load every trainer and the coordinator state from `path` (a run-directory path or a storage URI);
        by default from the newest checkpoint that is intact, falling back to older ones (and saying so)
        when the newest is damaged (a missing, truncated or altered file). A trainer that dies or hangs while
        loading is a trainer failure (see `recover`), not damage."""
        candidates = [as_checkpoint(path)] if path is not None else list(reversed(self.log.checkpoints()))
        if not candidates:
            raise FileNotFoundError(no_checkpoint(self.log))
        for i, candidate in enumerate(candidates):
            problem = checkpoint_problem(candidate) or runstore.reconcile(self.log, candidate)  # records: run/ in it
            if problem is None:
                problem = self._load_trainers(candidate)
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
                self.pool.close()
                try:
                    self.pool = self._start_trainers()
                except PlacementError as exc:  # the cluster cannot hold the trainers now (a node lost, ...)
                    hint = f"; once it can, continue with: marsi resume {self.log.dir}" if last is not None else ""
                    raise RunFailed(f"{failure}; the trainers could not be restarted: {exc}; last good checkpoint: "
                                    f"{last}{hint}") from exc
                self._check_storage_reach()  # restarted trainers may sit on other nodes
                if last is not None:
                    self.restore()
                return
            except TrainerFailure as again:
                failure = again

    def request_stop(self) -> None:
        """Stop at the next safe point (after the current step), with a checkpoint."""
        self.stop_requested = True

    def parameters_digests(self, agents: list[str] | None = None) -> dict[str, str]:
        """SHA-256 of each agent's weights (every agent by default; partner trainers by name)."""
        return self.pool.ask(Agent.digest, agents or self.config.agents)

    def load_weights(self, checkpoint: str | Path | Location) -> None:
        """Load every agent's weights from an intact checkpoint, leaving the coordinator's own state as it is."""
        checkpoint = as_checkpoint(checkpoint)
        problem = checkpoint_problem(checkpoint) or self._load_trainers(checkpoint)
        if problem:
            raise FileNotFoundError(f"checkpoint {checkpoint} cannot be loaded: {problem}")

    def _evaluated(self) -> bool:
        """Whether the run's records already hold an evaluation of the current step."""
        return self.log is not None and any(r["step"] == self.state.step and "eval/reward/mean" in r
                                            for r in self.log.metrics())

    def _with_recovery(self, fn):
        while True:
            try:
                return fn()
            except TrainerFailure as failure:
                self.recover(failure)

    def log_step(self, metrics: dict[str, Any], episodes: list[rollout.Episode]) -> None:
        """Write a step's metrics row (`metrics["step"]`: the steps done) to metrics.jsonl and the loggers, and
        `train.transcripts_per_step` of its episodes, spread over their samples, to transcripts.jsonl (bounded by
        `train.transcripts_max_mb`): what `marsi plot` and `marsi report` read. Nothing without a run directory."""
        if self.log is None:
            return
        cfg = self.config.train
        self.log.log_metrics(metrics)
        self.log.log_transcripts(metrics["step"], [e.transcript() for e in spread(episodes, cfg.transcripts_per_step)],
                                 max_mb=cfg.transcripts_max_mb)

    def evaluate(self, step: int | None = None) -> dict[str, float]:
        """Run the held-out evaluation now at the current weights; logs an `eval/` row at `step` (default: the steps
        done; a custom loop that checkpoints after evaluating passes the step it reached)."""
        if self.evaluation is None:
            raise ConfigError("evaluate(): the config has no eval: section")
        step = self.state.step if step is None else step
        result = self.evaluation.run(self.generate, self.assignment, initial=self.untrained)
        # every episode's values, what `compare` pairs (the transcripts are in the run's records already)
        self.eval_results.append((step, replace(result, transcripts=[])))
        row = {"step": step, **result.metrics}
        if self.log is not None:
            self.log.log_metrics(row)
            self.log.log_transcripts(step, result.transcripts, name=EVAL_TRANSCRIPTS,
                                     max_mb=self.config.train.transcripts_max_mb)
        return row

    # -------------------------------------------------------------------------------------- run
    def run(self, until: int | None = None) -> list[dict[str, Any]]:
        """Train until `until` steps are done (default `train.steps`) or a stop is requested; returns
        the metrics of the steps run here. A dead or hung trainer is restarted from the last checkpoint."""
        cfg = self.config.train
        until = cfg.steps if until is None else min(until, cfg.steps)
        if self.log is not None and self.log.latest_checkpoint() is None:
            self._with_recovery(self._save_checkpoint)  # step 0: something to restart from
        if self.evaluation is not None and self.evaluation.due(self.state.step) and not self._evaluated():
            began = time.perf_counter()
            row = self._with_recovery(self.evaluate)  # before the first step, or one a kill cut short
            phase(f"evaluation at step {self.state.step}: eval/reward/mean {row['eval/reward/mean']:.3f}",
                  time.perf_counter() - began)
        if self.lag_note:
            self.warn_once("rollouts", "lag", self.lag_note)
        bar = progress(self.state.step, until, cfg.progress)
        history, failed_at = [], None
        self._with_recovery(lambda: memory_plan.prepare(self, self.state.step, start=True))  # optimizer state: where updates come
        rollouts = self._rollouts()
        try:  # the bar is closed whatever happens, so an error starts a line of its own
            while self.state.step < until and not self.stop_requested:
                self._seconds.clear()
                start = time.perf_counter()
                try:
                    # rollout: played now, or ahead while earlier steps updated (train.max_staleness)
                    step = self.state.step
                    episodes, position = rollouts.take(step)
                    # advantages
                    experiences, value_targets = self.advantages(episodes)
                    # update: the scheduled agents only, on the actions fresh enough (the others' are dropped);
                    # critics every step
                    scheduled = self.schedule.training_agents(step)
                    usable, staleness = rollouts.usable(step, episodes, {a: experiences[a] for a in scheduled
                                                                         if a in experiences}, scheduled)
                    training = [a for a in scheduled if a in usable]
                    rollouts.updating(step, training)
                    results = self.train({a: usable[a] for a in training})
                    self.state.versions.update({a: r.policy_version for a, r in results.items()})
                    memory_plan.prepare(self, step + 1)  # release until the next update, fetch for the next step
                    rollouts.updated(step, training)
                    critic_results = self.train_critics(value_targets)
                    self.state.step += 1
                    # log
                    metrics = step_metrics(self.state.step, episodes, results, self._seconds, time.perf_counter() - start)
                    metrics.update(critic_metrics(critic_results, self._seconds))
                    metrics.update(staleness)
                    metrics.update(rollouts.metrics((start, time.perf_counter())))
                    metrics["data/epoch"] = position.epoch + position.index / len(self.samples)
                    metrics.update(zero_variance_metrics(episodes, self.config.algorithm))
                    for agent in sorted(set(scheduled) - set(training) - set(experiences)):
                        metrics[f"no_experiences/{agent}"] = 1
                        self.warn_once(agent, "idle", f"agent {agent!r} is scheduled to train but got no experiences at "
                                       f"step {self.state.step} (no role it holds was prompted); its update is skipped "
                                       f"(counted in no_experiences/{agent})")
                    if failed_at is not None:
                        metrics["time/recovery"], failed_at = time.perf_counter() - failed_at, None
                    self.log_step(metrics, episodes)
                    # evaluate (before the checkpoint: a kill during it replays the step and the evaluation)
                    if self.evaluation is not None and self.evaluation.due(self.state.step):
                        self.evaluate()
                    # checkpoint
                    every = cfg.checkpoint_every
                    at_end = self.state.step == cfg.steps or self.stop_requested
                    if self.log is not None and ((every and self.state.step % every == 0) or at_end):
                        rollouts.hand_over()
                        self._save_checkpoint()
                except OSError as exc:  # a full or read-only disk under the run directory
                    if self.log is None:
                        raise
                    raise RunDirError(self.log.disk_problem(exc)) from exc
                except TrainerFailure as failure:
                    failed_at = time.perf_counter()
                    rollouts.close()
                    self.recover(failure)  # back to the last checkpoint; its later steps are replayed
                    rollouts = self._rollouts()
                    history = [m for m in history if m["step"] <= self.state.step]
                    bar.reset(until)
                    bar.update(self.state.step)
                    continue
                history.append(metrics)
                show_step(bar, metrics)
            rollouts.hand_over()  # what a later run() or checkpoint continues from
        finally:
            rollouts.close()
            bar.close()
        return history

    def _rollouts(self) -> SyncRollouts | AsyncRollouts:
        """Where the steps' episodes come from: played at each step, or `self.lag` steps ahead."""
        return AsyncRollouts(self, self.lag) if self.lag else SyncRollouts(self)


def no_checkpoint(log: RunLog) -> str:
    """Why a run cannot be resumed: no complete checkpoint where its checkpoints go (named, since with
    train.storage that is not the run directory)."""
    where = "" if log.storage is None else f" in {log.checkpoint_dir()}"
    renamed = "" if log.storage is None or recorded_place(log.dir) is not None else (
        "; the run's place in storage is named after its run directory when it began, so a renamed run directory "
        "looks under its new name: resume the place itself, marsi resume STORAGE/RUN_NAME")
    return f"{log.dir}: no complete checkpoint to resume from{where}; start the run anew with marsi run{renamed}"


class ResumeError(UserError, ValueError):
    """Overrides that cannot apply to a run's checkpoints; nothing in the run directory was changed."""


def check_resume(config: RunConfig, stored: RunConfig, log: RunLog) -> None:
    """Refuse, before anything is touched, a resume whose config cannot continue the run's checkpoints."""
    done = log.steps_done()
    if done is None:
        raise FileNotFoundError(no_checkpoint(log))
    if set(config.agents) != set(stored.agents):
        raise ResumeError(f"{log.dir}: a resumed run keeps its agents ({', '.join(stored.agents)}); the overrides make "
                          f"them {', '.join(config.agents)}; start a new run for other agents")
    kept, given = _critic_label(stored), _critic_label(config)
    if given != kept:
        raise ResumeError(f"{log.dir}: a resumed run keeps its critic ({kept}); the overrides make it {given}; start a "
                          "new run for another critic")
    if config.train.steps < done:
        raise ResumeError(f"train.steps={config.train.steps} is below the {done} steps {log.dir} has done; "
                          f"give train.steps >= {done}")
    if config.train.storage != stored.train.storage:
        given = f"train.storage={config.train.storage!r}" if config.train.storage else "train.storage unset"
        kept = repr(stored.train.storage) if stored.train.storage else f"the run directory, {log.dir / 'checkpoints'}"
        raise ResumeError(f"{given}: a resumed run keeps its checkpoint storage ({kept}); copy the checkpoints and "
                          "start a new run to move them")
    from agent_trainer.models import architecture_mismatch

    checkpoint = log.latest_checkpoint()
    for name, agent in config.agents.items():
        if agent.model == stored.agents[name].model:
            continue
        with _saved_model_config(checkpoint / "agents" / name / "model") as saved:
            problem = architecture_mismatch(agent.model, saved) if saved is not None else None
        if problem:
            raise ResumeError(f"agents.{name}.model={agent.model!r}: {problem}, so the checkpoint's weights "
                              "cannot load into it; resume with the run's model")


def _critic_label(config: RunConfig) -> str:
    critic = config.critic
    return f"critic.kind {critic.kind}, critic.model {critic.model}" if critic else "none"


@contextlib.contextmanager
def _saved_model_config(saved: Location):
    """A local directory holding the config.json of a checkpoint's saved model (fetched from the store into
    a temporary directory), or None when the checkpoint holds no weights (a frozen agent's)."""
    with tempfile.TemporaryDirectory(prefix="marsi-config-") as tmp:
        try:
            (Path(tmp) / "config.json").write_bytes(storage.read_bytes(saved / "config.json"))
        except OSError:
            yield None
            return
        yield tmp


class RunFailed(RuntimeError):
    """The run stopped: a trainer kept failing or could not be restarted; names the last good checkpoint."""


def say(message: str) -> None:
    print(f"marsi: {message}", file=sys.stderr, flush=True)
