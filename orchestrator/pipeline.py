"""Where a step's episodes come from: played at the step (`SyncRollouts`, `train.max_staleness: 0`), or played
ahead in a background thread while the coordinator updates (`AsyncRollouts`, K > 0).

The step loop (`orchestrator.step_loop`) is one loop over either: `take(step)` the step's episodes, `usable(...)`
what its updates may use of them, `updating` / `updated` around the updates, `hand_over` before a checkpoint,
`close` at the end. Both read the coordinator through `RolloutSource` (`orchestrator.rollout_source`).

Asynchronous rollouts (see `orchestrator.staleness` for the words). The rollout of step r is drawn with each
agent's weights after the updates of the steps before `weights_step(r, L, base)`; two gates make that exact,
whatever the timing:

- a generate of agent X for rollout r waits until X's updates of those steps are done (an agent that does not
  train at a step passes that step's gate as soon as the step's updates are decided);
- with the rollout engine in the learner's process (`rollout.placement: colocated`) an update of step s waits
  until the rollouts of steps up to s + L are played, since they need the weights it is about to change; an
  engine of its own (`separate`) takes the version each generate names from what its learner published.

So every action's policy version is a function of the schedule and the data, not of timing; every generate is
seeded by its request; and a run with K > 0 replays exactly. What overlaps: the rollouts of agents that do not
train at a step with the updates of those that do, and the coordinator's own work (environments, advantages,
logging, checkpoints) with both, and, for an agent whose engine runs apart from its learner
(`pool.engines_apart`: `rollout.placement: separate`), its own generate with its own update.

A checkpoint after step s keeps the rollouts of steps s+1 .. s+L, already played with weights it no longer
holds, in the coordinator state; any rollout further ahead is discarded and, on resume, played again with the
checkpoint's weights and the same seeds, to the same episodes. The run's last checkpoint is no exception: the
pipeline plays the L rollouts after `train.steps` too (the generation of L steps more at the end), so a finished
run extended with `marsi resume RUN train.steps=M` goes on as a run of M steps would have.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from agent_trainer.agent import Agent
from orchestrator import rollout
from orchestrator.data import DataPosition, next_batch
from orchestrator.rollout_source import RolloutSource
from orchestrator.staleness import (
    Usable, clipped, length, timing_metrics, union, usable_actions, weights_step,
)
from protocols.messages import Experience, GenerateRequest


class SyncRollouts:
    """Each step plays its own episodes, with the weights of the step before: today's synchronous loop."""

    def __init__(self, source: RolloutSource):
        self.source = source

    def take(self, step: int) -> tuple[list[rollout.Episode], DataPosition]:
        source, cfg = self.source, self.source.config.train
        epoch = source.state.data.epoch
        samples = next_batch(source.samples, cfg.batch_size, source.state.data, cfg.seed, source.config.data.shuffle)
        if source.state.data.epoch != epoch:
            warn_epoch(source)
        return source.play(samples), source.state.data

    def usable(self, step: int, episodes: list[rollout.Episode], experiences: dict[str, list[Experience]],
               scheduled: list[str]) -> tuple[dict[str, list[Experience]], dict[str, Any]]:
        return experiences, {}

    def updating(self, step: int, training: list[str]) -> None:
        pass

    def settle(self, step: int) -> None:
        pass

    def updated(self, step: int, training: list[str]) -> None:
        pass

    def metrics(self, window: tuple[float, float]) -> dict[str, Any]:
        return {}

    def hand_over(self) -> None:
        pass

    def close(self) -> None:
        pass


def warn_epoch(source: RolloutSource) -> None:
    source.warn_once("data", "epoch", f"data: all {len(source.samples)} samples used; going round again"
                     f"{' (reshuffled each epoch)' if source.config.data.shuffle else ''}; data/epoch counts")


@dataclass
class Played:
    """One step's rollout, played ahead: its episodes and where the data and episode counters stood."""

    step: int
    data_before: DataPosition
    episodes_before: int
    data_after: DataPosition
    episodes_after: int
    episodes: list[rollout.Episode]

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "data_before": asdict(self.data_before), "episodes_before": self.episodes_before,
                "data_after": asdict(self.data_after), "episodes_after": self.episodes_after,
                "episodes": [e.record() for e in self.episodes]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Played:
        return cls(step=record["step"], data_before=DataPosition(**record["data_before"]),
                   episodes_before=record["episodes_before"], data_after=DataPosition(**record["data_after"]),
                   episodes_after=record["episodes_after"],
                   episodes=[rollout.Episode.from_record(e) for e in record["episodes"]])


def kept_rollouts(records: list[dict[str, Any]], step: int, lag: int) -> tuple[list[dict[str, Any]], dict | None]:
    """Of the rollouts a checkpoint after `step` steps kept, those a run with `lag` uses (steps below step + lag),
    and where the data stood before the first one it does not (None when it uses all): that one and those after
    it are played again."""
    kept = [r for r in records if r["step"] < step + lag]
    dropped = [r for r in records if r["step"] >= step + lag]
    return kept, (min(dropped, key=lambda r: r["step"]) if dropped else None)


class _Stopped(Exception):
    """The pipeline closed while its producer waited or played."""


class AsyncRollouts:
    """Rollouts played `lag` steps ahead by a background thread, in step order, behind the version gates."""

    def __init__(self, source: RolloutSource, lag: int):
        self.source, self.lag = source, lag
        cfg, state = source.config, source.state
        self.agents = list(cfg.agents)
        self.bounds = source.plan.staleness_bounds
        self.apart = set(getattr(source.pool, "engines_apart", ()))  # agents whose rollout engine is a process of its own
        self.pushed = set(getattr(source.pool, "engines_pushed", ()))  # of those, engines that hold one version only
        self.steps = cfg.train.steps
        self.limit = self.steps + lag  # the first step not played: the last checkpoint keeps the L after the run's end
        self.base = state.step
        self.played: dict[int, Played] = {r["step"]: Played.from_record(r) for r in state.rollouts}
        self.next_play = max(self.played, default=self.base - 1) + 1
        self.cursor = (copy.copy(state.data), state.episodes)  # where the next rollout to play draws from
        self.last_taken: Played | None = None
        versions = {a: state.versions.get(a, 0) for a in self.agents}
        self.through = dict.fromkeys(self.agents, self.base)  # weights after the steps before this are in place
        self.version_at = {a: {self.base: versions[a]} for a in self.agents}  # agent -> step -> version after steps < it
        self.calls: list[tuple[str, str, float, float]] = []  # (agent, generate | update, start, end)
        self.running: dict[str, float] = {}  # agent -> the start of its generate under way
        self.update_start = 0.0
        self.failure: BaseException | None = None
        self.stopped = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._produce, name="marsi-rollouts", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------ the producer
    def _produce(self) -> None:
        source, cfg = self.source, self.source.config.train
        try:
            while self.next_play < self.limit:
                step = self.next_play
                data, episodes_before = self.cursor
                before = copy.copy(data)
                epoch = data.epoch
                samples = next_batch(source.samples, cfg.batch_size, data, cfg.seed, source.config.data.shuffle)
                if data.epoch != epoch and step < self.steps:
                    warn_epoch(source)
                episodes = rollout.play(source.make_env, samples, cfg.num_generations, source.assignment,
                                        self._generate_for(step), seed=cfg.seed, first_episode=episodes_before,
                                        attempts=source.config.roles.attempts)
                after = episodes_before + len(episodes)
                with self.cond:
                    self.played[step] = Played(step, before, episodes_before, copy.copy(data), after, episodes)
                    self.cursor = (data, after)
                    self.next_play = step + 1
                    self.cond.notify_all()
        except _Stopped:
            pass
        except BaseException as exc:  # a trainer or environment failure: the coordinator raises it where it waits
            with self.cond:
                self.failure = exc
                self.cond.notify_all()

    def _generate_for(self, step: int):
        need = weights_step(step, self.lag, self.base)

        def generate(prompts, seed):
            with self.cond:
                self.cond.wait_for(lambda: self.stopped or all(self.through[a] >= need for a in prompts))
                if self.stopped:
                    raise _Stopped
                versions = {a: self.version_at[a][need] for a in prompts}
            self.source.check_agents(prompts, "generate")
            requests = {a: GenerateRequest(prompts=p, seed=rollout.derive_seed(seed, a), policy_version=versions[a])
                        for a, p in prompts.items() if p}
            start = time.perf_counter()
            with self.cond:
                self.running.update(dict.fromkeys(requests, start))
            try:
                results = self.source.pool.each(Agent.generate, requests)
            finally:
                with self.cond:
                    for a in requests:
                        del self.running[a]
            end = time.perf_counter()
            with self.cond:
                self.calls.extend((a, "generate", start, end) for a in requests)
            return {a: r.completions for a, r in results.items()}

        return generate

    # -------------------------------------------------------------------------- the step loop's side
    def _wait(self, ready) -> None:
        """Wait under the lock until `ready()`; the producer's failure is raised here."""
        with self.cond:
            self.cond.wait_for(lambda: ready() or self.failure is not None or not self.thread.is_alive())
            if self.failure is not None:
                raise self.failure
            if not ready():
                raise RuntimeError("the rollout thread ended before the rollouts the step needs")

    def _played_through(self, step: int) -> bool:
        return self.next_play > min(step, self.limit - 1)

    def take(self, step: int) -> tuple[list[rollout.Episode], DataPosition]:
        self._wait(lambda: step in self.played)
        with self.cond:
            self.last_taken = self.played.pop(step)
        return self.last_taken.episodes, self.last_taken.data_after

    def usable(self, step: int, episodes: list[rollout.Episode], experiences: dict[str, list[Experience]],
               scheduled: list[str]) -> tuple[dict[str, list[Experience]], dict[str, Any]]:
        learners = {a: self.source.state.versions.get(a, 0) for a in self.agents}
        found: Usable = usable_actions(episodes, learners, self.bounds)
        kept = {}
        for agent, exps in experiences.items():
            flags = found.keep.get(agent, [])
            if len(flags) != len(exps):
                raise RuntimeError(f"agent {agent!r}: {len(exps)} experiences for {len(flags)} actions")
            kept[agent] = [e for e, keep in zip(exps, flags) if keep]
            if not kept[agent]:
                del kept[agent]
                self.source.warn_once(agent, "stale", f"agent {agent!r}: every action of its at step {step + 1} was more "
                                      f"than {self.bounds[agent]} policy versions behind (its own or a partner's), so "
                                      "its update is skipped (counted in staleness/NAME/dropped)")
        return kept, found.metrics(scheduled)

    def updating(self, step: int, training: list[str]) -> None:
        """Before the updates of `step`: agents that do not train at it already hold their weights after it; with
        colocated engines, the rollouts that still need the weights about to change must be played first."""
        with self.cond:
            for agent in self.agents:
                if agent not in training:
                    self.version_at[agent][step + 1] = self.version_at[agent][max(self.version_at[agent])]
                    self.through[agent] = step + 1
            self.cond.notify_all()
        if set(training) - self.apart:
            self._wait(lambda: self._played_through(step + self.lag))
        elif pushed := sorted(set(training) & self.pushed):
            # an engine fed by a weight channel holds one version and can take only its learner's current one: the
            # rollouts that draw with older weights are played first, and the current weights are put into the
            # engine now if a rollout still to play draws with them (the one `lag` steps ahead)
            self._wait(lambda: self._played_through(step + self.lag - 1))
            if not self._played_through(step + self.lag):  # with those of their hosts' other agents
                self.source.pool.push_before_update(pushed)
        self.update_start = time.perf_counter()

    def settle(self, step: int) -> None:
        """Before an evaluation after the updates of the steps before `step`: with an engine that holds one version
        (a weight channel), the rollouts that draw with older weights are played first, so that the evaluation's
        newest weights do not replace them under a rollout still playing."""
        if self.pushed:
            self._wait(lambda: self._played_through(step - 1 + self.lag))

    def updated(self, step: int, training: list[str]) -> None:
        end = time.perf_counter()
        with self.cond:
            self.calls.extend((a, "update", self.update_start, end) for a in training)
            for agent in training:
                self.version_at[agent][step + 1] = self.source.state.versions.get(agent, 0)
                self.through[agent] = step + 1
            for versions in self.version_at.values():  # what no rollout still to play can ask for
                for old in [s for s in versions if s < step + 1 - self.lag]:
                    del versions[old]
            self.cond.notify_all()

    def metrics(self, window: tuple[float, float]) -> dict[str, Any]:
        """Overlap and idle time of the step in `window`, and its generate, update and coordinator seconds
        measured from the calls (generation for later steps included, a generate still under way up to the
        window's end: the rest of it falls in the next step's)."""
        with self.cond:
            self.calls = [c for c in self.calls if c[3] > window[0]]
            calls = self.calls + [(a, "generate", start, window[1]) for a, start in self.running.items()]
        out = timing_metrics(calls, window, self.agents)
        gens = clipped([(c[2], c[3]) for c in calls if c[1] == "generate"], window)
        ups = clipped([(c[2], c[3]) for c in calls if c[1] == "update"], window)
        out["time/generate"] = length(gens)
        out["time/update"] = length(ups)
        out["time/coordinator"] = (window[1] - window[0]) - length(union(gens + ups))
        return out

    def hand_over(self) -> None:
        """Put into the coordinator state what a checkpoint (or the next `run()`) needs: the rollouts of the steps
        after `state.step` that were played with older weights than it holds (steps up to state.step + lag - 1),
        and the data and episode counters after the last of them."""
        state = self.source.state
        last = min(state.step + self.lag, self.limit) - 1
        self._wait(lambda: self._played_through(last))
        with self.cond:
            keep = [self.played[s] for s in range(state.step, last + 1)]
        state.rollouts = [p.record() for p in keep]
        if keep:
            state.data, state.episodes = copy.copy(keep[-1].data_after), keep[-1].episodes_after
        elif self.last_taken is not None:
            state.data, state.episodes = copy.copy(self.last_taken.data_after), self.last_taken.episodes_after

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join()
