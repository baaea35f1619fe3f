"""The processes a run holds: its claim on the run directory, Ray (when the run started it) and the trainer pool;
the check that every trainer's node reaches the store, and the precision each agent got."""

from __future__ import annotations

import secrets
import time
from collections import defaultdict
from typing import Any, Callable

from agent_trainer.agent import Agent
from agent_trainer.handle import TrainerFailure, TrainerPool
from agent_trainer.precision import emulation_warning
from agent_trainer.priority import described
from agent_trainer.storage import StorageError
from orchestrator.console import phase, say
from orchestrator.runlog import RunLog
from orchestrator.schedule import Schedule
from protocols.config import AgentConfig, RunConfig
from protocols.messages import ProbeRequest
from protocols.plan import RunPlan, with_partners


class Session:
    """Starts and closes what a coordinator runs on. `pool` is every member's handle while started (None before
    and after); `startup` the seconds start took (Ray, the trainers, the slowest model load, all of it);
    `precision` per agent: dtype, reason, machine, slowdown (`agent_trainer.precision.Precision`)."""

    def __init__(self, config: RunConfig, plan: RunPlan, schedule: Schedule, members: list[str],
                 partners: dict[str, AgentConfig], sits_in_for: dict[str, str], log: RunLog | None, *, resuming: bool,
                 take_over: bool):
        self.config, self.plan, self.schedule, self.members, self.log = config, plan, schedule, members, log
        self.partners, self.sits_in_for = partners, sits_in_for  # evaluation partners -> the agent each sits in for
        self.resuming, self.take_over = resuming, take_over
        self.pool: TrainerPool | None = None
        self.untrained = True  # every agent at its initial weights: no update and no load yet
        self.owns_ray = False
        self.startup: dict[str, float] = {}
        self.precision: dict[str, dict[str, Any]] = {}

    def start(self, with_recovery: Callable[[Callable[[], Any]], Any]) -> None:
        """Claim the run directory, start Ray when enabled and the trainers, and check that they reach the store
        (`with_recovery`: a trainer that dies meanwhile is restarted); a started session stays as it is. A new run
        writes its config here; a resumed one once its checkpoint is restored."""
        if self.pool is not None:
            return
        if self.log is not None:
            self.log.claim(resume=self.resuming, take_over=self.take_over)
        began = time.perf_counter()
        try:
            if self.config.ray.enabled:
                from agent_trainer.actor import start_ray

                self.owns_ray = start_ray(self.config, self.plan)
                phase("Ray started" if self.owns_ray else "joined Ray", time.perf_counter() - began)
            ray_up = time.perf_counter()
            self.pool = self.start_trainers()
            trainers_up = time.perf_counter()
            loaded = {a: max((w.get("load_s", 0.0) for w in i.get("workers", [i])), default=0.0)
                      for a, i in self.pool.start_info.items()}
            phase(f"{len(loaded)} trainer(s) up; model load " + ", ".join(f"{a} {s:.1f} s" for a, s in loaded.items()),
                  trainers_up - ray_up)
            with_recovery(self.check_storage_reach)
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
        self.say_precision()
        transfers = {a: i["weight_transfer"] for a, i in info.items() if "weight_transfer" in i}
        if transfers:
            ranks = {a: (described(info[a]["rollout_engine"]), described(info[a])) for a in transfers}
            print("marsi: weights to the rollout engines apart: " + "; ".join(
                f"{a} by {t}" + (f" (engine {ranks[a][0]}, its learner {ranks[a][1]})"
                                 if ranks[a][0] != ranks[a][1] else "") for a, t in transfers.items()), flush=True)
        if self.log is not None and not self.resuming:
            self.log.write_config(self.config)
            self.log.snapshot_sources([self.config.environment.name, self.config.data.factory])

    def say_precision(self) -> None:
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

    def start_trainers(self) -> TrainerPool:
        """A new pool: one trainer per agent and critic, then one per evaluation partner."""
        config = self.config
        if self.partners:  # partner trainers come last, so the agents' own seeds and indices stay as they are
            frozen = config.schedule.model_copy(update={"frozen": [*config.schedule.frozen, *self.partners]})
            config = config.model_copy(update={"agents": {**config.agents, **self.partners}, "schedule": frozen})
        updates = {a: self.schedule.updates(a, self.config.train.steps) if a in self.config.agents else 0
                   for a in config.agents}
        if config.ray.enabled:
            from agent_trainer.actor import RayTrainers

            return RayTrainers(config, with_partners(self.plan, config, self.sits_in_for), updates)
        from agent_trainer.group import LocalTrainers

        return LocalTrainers(config, with_partners(self.plan, config, self.sits_in_for), updates)

    def check_storage_reach(self) -> None:
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
        """Close the trainers, shut Ray down when this session started it, release the run directory."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.owns_ray:
            import ray

            ray.shutdown()
            self.owns_ray = False
        if self.log is not None:
            self.log.release()
