"""Coordinator: starts one trainer per agent, plays episodes, scores them, and trains on the schedule.

Its primitives (`generate`, `train`, `checkpoint`, `restore`) serve custom coordinator scripts; `run()` is the
standard loop built from them (`orchestrator.step_loop`). Its parts own their state: `session` the processes
(Ray, the trainer pool), `checkpoints` the coordinator state with its checkpoints and the recovery from them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

from agent_trainer.agent import Agent
from agent_trainer.critic import Critic
from agent_trainer.handle import TrainerFailure
from orchestrator import rollout, runstore
from orchestrator.baselines import experiences_by_agent, uses_critic
from orchestrator.checkpoint_files import EVAL_TRANSCRIPTS
from orchestrator.checkpoints import Checkpoints
from orchestrator.console import say
from orchestrator.credit import CriticCredit
from orchestrator.data import load_samples
from orchestrator.evaluation import EvalResult, Evaluation, partner_agents, partner_seats
from orchestrator.memory_plan import MemoryPlan
from orchestrator.preflight import check_environment
from orchestrator.resume import check_resume
from orchestrator.runlog import RunLog
from orchestrator.schedule import RoleAssignment, Schedule, attempts_problem, seating_problem
from orchestrator.session import Session
from orchestrator.staleness import planned_lag
from orchestrator.step_loop import StepLoop
from orchestrator.steplog import spread
from protocols.config import ConfigError, RunConfig, load_config
from protocols.plan import plan_of
from protocols.messages import (
    Completion, CriticUpdateRequest, CriticUpdateResult, Experience, GenerateRequest, Location, Prompt, UpdateRequest,
    UpdateResult, ValueRequest, ValueTarget, check_experiences,
)


class Coordinator:
    """`with Coordinator(config, run_dir) as coord: coord.run()`. `run_dir` must hold no run yet (see
    `Coordinator.resume` to continue one); None keeps no records and no checkpoints.

    Attributes a custom loop reads: `step` (steps done), `restored_from` (the checkpoint `restore` loaded,
    or None), `loop_state` (its own JSON state, saved by `checkpoint` and given back by `restore`)."""

    def __init__(self, config: RunConfig, run_dir: str | Path | None = None, *, resume: bool = False,
                 take_over: bool = False):
        """`take_over`: take over the run's lease in its store from a run that is gone (`orchestrator.lease`)."""
        self.config = config
        self.plan = plan_of(config)  # hosts, critics, staleness bounds, engine sizes: derived once (protocols.plan)
        self.schedule = Schedule(config.schedule, list(config.agents))
        self.lag, self.lag_note = planned_lag(config, self.schedule, self.plan.staleness_bounds)
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
        self.critics = self.plan.critic_members  # critic -> the agents it values (algorithm.baseline: critic)
        self.members = [*config.agents, *self.critics]  # what a checkpoint holds: every agent and critic
        self.credit = CriticCredit(config, self.plan) if uses_critic(config.algorithm) else None  # chosen once
        self.log = (RunLog(run_dir, config.logging, config.train.storage, config.train.storage_timeout_s)
                    if run_dir is not None else None)
        self.session = Session(config, self.plan, self.schedule, self.members, self.partners, self.sits_in_for,
                               self.log, resuming=resume, take_over=take_over)
        self.checkpoints = Checkpoints(config, self.session, self.schedule, self.members, self.lag, self.max_turns)
        self.memory = MemoryPlan(config, self.schedule, self.lag)  # whose optimizer state is resident when
        self.stop_requested = False
        self.seconds: dict[str, float] = defaultdict(float)  # this step's time in the primitives, by kind
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
        self.session.start(self.checkpoints.with_recovery)

    def close(self) -> None:
        self.session.close()

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
                coord.checkpoints.resume()
            except BaseException:
                coord.close()
                raise
        return coord

    # the parts' state, read through the coordinator
    pool = property(lambda self: self.session.pool, doc="Every agent's handle while started: `self.pool[agent]`.")
    startup = property(lambda self: self.session.startup, doc="Seconds: Ray, the trainers, the slowest model load, "
                       "all of `start()`.")
    precision = property(lambda self: self.session.precision, doc="Per agent: dtype, reason, machine, slowdown.")
    state = property(lambda self: self.checkpoints.state, doc="The coordinator state (`CoordinatorState`) now.")
    restored_from = property(lambda self: self.checkpoints.restored_from, doc="The checkpoint restore loaded, or None.")
    restarts = property(lambda self: self.checkpoints.restarts, doc="Trainer restarts so far.")

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

    def check_agents(self, agents: Iterable[str], action: str) -> None:
        """Refuse (`ConfigError`) an agent that is not defined (partner trainers may generate), or, to "train",
        one that is frozen."""
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
        self.check_agents(prompts, "generate")
        start = time.perf_counter()
        requests = {a: GenerateRequest(prompts=p, seed=rollout.derive_seed(seed, self.sits_in_for.get(a, a)),
                                       temperature=temperature)
                    for a, p in prompts.items() if p}
        results = self.pool.each(Agent.generate, requests)
        self.seconds["generate"] += time.perf_counter() - start
        return {a: r.completions for a, r in results.items()}

    def train(self, experiences: dict[str, list[Experience]]) -> dict[str, UpdateResult]:
        """Update each named agent on its experiences now, all agents at once. Every experience is checked
        first: a non-finite advantage or log-prob stops the call before any agent trains."""
        self.check_agents(experiences, "train")
        for agent, exps in experiences.items():
            check_experiences(agent, exps)
        start = time.perf_counter()
        requests = {a: UpdateRequest(experiences=e) for a, e in experiences.items() if e}
        self.session.untrained = self.session.untrained and not requests
        results = self.pool.each(Agent.update, requests)
        self.seconds["update"] += time.perf_counter() - start
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
        self.seconds["critic"] += time.perf_counter() - start
        return {c: results[c].values if c in results else [] for c in states}

    def train_critics(self, targets: dict[str, list[ValueTarget]]) -> dict[str, CriticUpdateResult]:
        """Update each named critic on its value targets now, all critics at once."""
        start = time.perf_counter()
        requests = {c: CriticUpdateRequest(targets=t) for c, t in targets.items() if t}
        results = self.pool.each(Critic.update, requests)
        self.seconds["critic"] += time.perf_counter() - start
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
        return self.checkpoints.checkpoint(step)

    def restore(self, path: str | Path | Location | None = None) -> Location:
        """Load every trainer and the coordinator state from `path` (a run-directory path or a storage URI); by
        default from the newest intact checkpoint, falling back to older ones (`Checkpoints.restore`)."""
        return self.checkpoints.restore(path)

    def recover(self, failure: TrainerFailure) -> None:
        """Restart every trainer and restore the last good checkpoint (before the run's first checkpoint:
        start afresh); a failure while doing so spends another restart. Raise when that cannot help."""
        self.checkpoints.recover(failure)

    def load_weights(self, checkpoint: str | Path | Location) -> None:
        """Load every agent's weights from an intact checkpoint, leaving the coordinator's own state as it is."""
        self.checkpoints.load_weights(checkpoint)

    def request_stop(self) -> None:
        """Stop at the next safe point (after the current step), with a checkpoint."""
        self.stop_requested = True

    def parameters_digests(self, agents: list[str] | None = None) -> dict[str, str]:
        """SHA-256 of each agent's weights (every agent by default; partner trainers by name)."""
        return self.pool.ask(Agent.digest, agents or self.config.agents)

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
        result = self.evaluation.run(self.generate, self.assignment, initial=self.session.untrained)
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
        steps = self.config.train.steps
        return StepLoop(self, steps if until is None else min(until, steps)).run()
