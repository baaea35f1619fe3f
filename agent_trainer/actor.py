"""The Ray wrapper: one actor per agent, placed by a placement group, each on its own GPU or CPU share."""

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
from protocols.config import RayConfig, RunConfig
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
    """Holds one AgentTrainer; Ray pins it to its bundle, and CUDA_VISIBLE_DEVICES to its GPU."""

    def __init__(self, name, config, index, total_updates, threads):
        import torch

        from agent_trainer.group import TrainerStartError, return_freed_memory, start_trainer

        return_freed_memory()
        torch.set_num_threads(threads)
        self.node = node_label(ray.get_runtime_context().get_node_id())
        self.trainer, self.error = None, None
        try:
            self.trainer = start_trainer(name, config, index, total_updates, where=self.node)
        except TrainerStartError as exc:  # reported by info(), so the driver gets one clean line
            self.error = str(exc)

    def call(self, method: str | Callable, kwargs: dict[str, Any]):
        from agent_trainer.group import invoke

        return invoke(self.trainer, method, kwargs)

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "error": self.error, "node": ray.get_runtime_context().get_node_id(),
                "node_label": self.node,
                "device": str(self.trainer.device) if self.trainer else None,
                "engine": self.trainer.engine.name if self.trainer else None,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}


def node_label(node_id: str) -> str:
    """`node NAME (IP, id 0123abcd...)`: how messages name a Ray node (its name is its IP unless set with
    `ray start --node-name`)."""
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            name, ip = node.get("NodeName") or "?", node.get("NodeManagerAddress") or "?"
            return f"node {name} ({'' if name == ip else ip + ', '}id {node_id[:12]})"
    return f"node {node_id[:12]}"


class RayTrainers:
    """One Ray actor per agent; `call` fans out to all named agents, then gathers once."""

    def __init__(self, config: RunConfig, updates: dict[str, int]):
        from agent_trainer.group import TrainerStartError, num_threads

        from agent_trainer.group import placement_problem

        names = list(config.agents)
        total = ray.cluster_resources()
        problem = placement_problem(config, total.get("CPU", 0.0), total.get("GPU", 0.0), "the Ray cluster")
        if problem:  # cannot fit at all: say so now rather than after placement_timeout_s
            raise PlacementError(problem)
        bundles = [{"CPU": a.resources.num_cpus, **({"GPU": a.resources.num_gpus} if a.resources.num_gpus else {})}
                   for a in config.agents.values()]
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
        self.actors = {}
        for i, (name, agent) in enumerate(config.agents.items()):
            self.actors[name] = actor_cls.options(
                num_cpus=agent.resources.num_cpus, num_gpus=agent.resources.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                                     placement_group_bundle_index=i),
            ).remote(name, config, i, updates[name], num_threads(agent.resources.num_cpus))
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
        refs = {n: self.actors[n].call.remote(method, kwargs) for n, kwargs in kwargs_by_agent.items()}
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
                raise TrainerFailure(name, method_label, f"its process died ({reason})", recoverable=True) from None
            except ray.exceptions.RayTaskError as exc:
                raise TrainerFailure(name, method_label, describe(exc.cause or exc), recoverable=False) from None
        return results

    def info(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        names = list(self.actors)
        return dict(zip(names, ray.get([self.actors[n].info.remote() for n in names], timeout=timeout)))

    def close(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor)
        self.actors.clear()
        remove_placement_group(self.pg)
