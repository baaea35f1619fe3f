"""The Ray wrapper: one actor per host (one full-model agent, or adapter agents sharing a base model), placed
by a placement group, each on its own GPU or CPU share."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agent_trainer import reaper
from protocols.config import RayConfig, RunConfig, host_layout
from protocols.errors import UserError, describe, one_line


class PlacementError(UserError, RuntimeError):
    """The cluster cannot hold the trainers; the message lists what was asked and what is free."""


# Ray logs this on every start of a local cluster (and on joining one when a token file exists): a notice that
# its default, token authentication, is on. marsi leaves that default as it is and drops the notice; Ray's
# other messages (a warning that authentication is off included) still show.
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_RAY_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster."


def _not_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_RAY_AUTH_NOTICE)


def quiet_ray_startup() -> None:
    """Hide Ray's start-up notice that token authentication is on; nothing about authentication changes."""
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    if _not_auth_notice not in logger.filters:
        logger.addFilter(_not_auth_notice)


def init_ray(config: RayConfig) -> bool:
    """Join `config.address` or RAY_ADDRESS when set, else start a local cluster, watched so that it ends with
    this process however this process ends (agent_trainer/reaper.py); False if Ray was already up."""
    if ray.is_initialized():
        return False
    quiet_ray_startup()
    address = config.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level="WARNING")
        print(f"marsi: joined the Ray cluster at {address}", file=sys.stderr)
    else:
        context = ray.init(num_cpus=config.num_cpus, num_gpus=config.num_gpus, include_dashboard=False,
                           logging_level="WARNING")
        reaper.watch(context.address_info["session_dir"])  # ends the cluster if this process is killed
    return True


class _TrainerActor:
    """Holds one host (`agent_trainer.hosts.Host`): its agents' trainers; Ray pins it to its bundle, and
    CUDA_VISIBLE_DEVICES to its GPU."""

    def __init__(self, host, config, updates, threads):
        import torch

        from agent_trainer.group import TrainerStartError
        from agent_trainer.hosts import Host

        torch.set_num_threads(threads)
        self.node = node_label(ray.get_runtime_context().get_node_id())
        self.host, self.error = None, None
        try:
            self.host = Host(host, config, updates, where=self.node)
        except TrainerStartError as exc:  # reported by info(), so the driver gets one clean line
            self.error = str(exc)

    def call(self, agent: str, method: str | Callable, kwargs: dict[str, Any]):
        return self.host.call(agent, method, kwargs)

    def info(self) -> dict[str, dict[str, Any]]:
        """Per agent of this host: its process, node, device and engine (the start error, if any, under "")."""
        common = {"pid": os.getpid(), "error": self.error, "node": ray.get_runtime_context().get_node_id(),
                  "node_label": self.node, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
        if self.host is None:
            return {"": {**common, "device": None, "engine": None}}
        return {name: {**common, "host": self.host.name, "device": str(t.device), "engine": t.engine.name}
                for name, t in self.host.trainers.items()}


def node_label(node_id: str) -> str:
    """`node NAME (IP, id 0123abcd...)`: how messages name a Ray node (its name is its IP unless set with
    `ray start --node-name`)."""
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            name, ip = node.get("NodeName") or "?", node.get("NodeManagerAddress") or "?"
            return f"node {name} ({'' if name == ip else ip + ', '}id {node_id[:12]})"
    return f"node {node_id[:12]}"


class RayTrainers:
    """One Ray actor per host; `call` fans out to all named agents, then gathers once. Agents of one host are
    served by one actor, one call at a time; its death is a failure of each of them."""

    def __init__(self, config: RunConfig, updates: dict[str, int]):
        from agent_trainer.group import TrainerStartError, num_threads

        from agent_trainer.group import placement_problem

        layout = host_layout(config)
        names = list(layout)
        total = ray.cluster_resources()
        problem = placement_problem(config, total.get("CPU", 0.0), total.get("GPU", 0.0), "the Ray cluster")
        if problem:  # cannot fit at all: say so now rather than after placement_timeout_s
            raise PlacementError(problem)
        resources = [config.agents[agents[0]].resources for agents in layout.values()]  # a host's agents share it
        bundles = [{"CPU": r.num_cpus, **({"GPU": r.num_gpus} if r.num_gpus else {})} for r in resources]
        self.pg = placement_group(bundles, strategy=config.ray.placement_strategy)
        try:
            ray.get(self.pg.ready(), timeout=config.ray.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            asked = ", ".join(f"{n}: {b}" for n, b in zip(names, bundles))
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "memory")}
            raise PlacementError(
                f"trainers could not be placed within {config.ray.placement_timeout_s:.0f}s; asked for {asked}; "
                f"cluster has free {free}; lower agents.<name>.resources or add nodes"
            ) from None
        actor_cls = ray.remote(_TrainerActor)
        self.hosts, self.actors = {}, {}  # host -> actor; agent -> its host's actor
        for i, ((host, agents), r) in enumerate(zip(layout.items(), resources)):
            self.hosts[host] = actor_cls.options(
                num_cpus=r.num_cpus, num_gpus=r.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=i),
            ).remote(host, config, updates, num_threads(r.num_cpus))
            self.actors.update(dict.fromkeys(agents, self.hosts[host]))
        self.layout = layout
        self.housemates = {agent: agents for agents in layout.values() for agent in agents}
        try:  # waits until every trainer is up
            errors = [i["error"] for i in self.info(timeout=config.train.start_timeout_s).values() if i["error"]]
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise TrainerStartError(f"trainers were not up within train.start_timeout_s="
                                    f"{config.train.start_timeout_s:g}s after placement; raise it for large models "
                                    "or check the trainer processes") from None
        if errors:
            self.close()
            raise TrainerStartError(errors[0])

    def call(self, method: str | Callable, kwargs_by_agent: dict[str, dict[str, Any]],
             timeout: float | None = None) -> dict:
        """Fan out to every named agent, then gather; a dead, hung or raising trainer is a TrainerFailure.
        `method`: a trainer method's name, or a function run in the trainer's process (`agent_trainer.storage`)."""
        from agent_trainer.group import TrainerFailure, method_name

        method_label = method_name(method)
        refs = {n: self.actors[n].call.remote(n, method, kwargs) for n, kwargs in kwargs_by_agent.items()}
        deadline = None if timeout is None else time.monotonic() + timeout
        results = {}
        for name, ref in refs.items():
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                results[name] = ray.get(ref, timeout=left)
            except ray.exceptions.GetTimeoutError:
                raise TrainerFailure(name, method_label, f"no answer within {timeout:g}s (hung)", recoverable=True) from None
            except ray.exceptions.RayActorError as exc:
                reason = one_line(exc)[:200]
                shared = [a for a in self.housemates[name] if a != name]
                whose = f" (the host it shares with {', '.join(shared)})" if shared else ""
                raise TrainerFailure(name, method_label, f"its process{whose} died ({reason})",
                                     recoverable=True) from None
            except ray.exceptions.RayTaskError as exc:
                raise TrainerFailure(name, method_label, describe(exc.cause or exc), recoverable=False) from None
        return results

    def info(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Per agent: pid, node, device, engine, ... (agents of one host share the pid); a host that could not
        start reports its error under each of its agents."""
        hosts = list(self.hosts)
        answers = ray.get([self.hosts[h].info.remote() for h in hosts], timeout=timeout)
        out = {}
        for host, agents in zip(hosts, answers):
            if "" in agents:  # the host did not start: its error stands for each of its agents
                agents = {a: agents[""] for a in self.layout[host]}
            out.update(agents)
        return out

    def close(self) -> None:
        for actor in self.hosts.values():
            ray.kill(actor)
        self.hosts.clear()
        self.actors.clear()
        remove_placement_group(self.pg)
