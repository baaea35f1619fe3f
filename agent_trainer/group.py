"""`LocalTrainers`: the pool (`agent_trainer.handle.TrainerPool`) whose trainers run in this process, and the
resource arithmetic both pools share.

The coordinator imports this module: torch and the trainer load only where trainers run."""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any, Callable

from agent_trainer.dispatch import declaration_of
from agent_trainer.handle import TrainerFailure, TrainerPool
from agent_trainer.heap import return_freed_memory
from protocols.config import RunConfig, label_matches
from protocols.errors import describe
from protocols.plan import RunPlan


def placement_problem(config: RunConfig, plan: RunPlan, cpus: float, gpus: float, where: str) -> str | None:
    """Why the hosts' resource requests (`plan.host_resources`) cannot fit `cpus` and `gpus` in all, and what to
    lower, or None. A host (an agent's own, or one adapter agents share) asks for its per-worker resources once per
    worker."""
    asked = dict(plan.host_resources)  # and a rollout engine of its own asks for its resources too
    asked.update({f"{name} (rollout engine)": r for name, r in plan.engine_resources.items()})
    shared = " (hosts.NAME.resources for a shared host)" if config.hosts else ""
    for kind, have, key in (("CPUs", cpus, "num_cpus"), ("GPUs", gpus, "num_gpus")):
        total = sum(getattr(r, key) * r.num_workers for r in asked.values())
        if total > have + 1e-9:
            each = ", ".join(f"{name}: {getattr(r, key):g}" + (f" x {r.num_workers} workers" if r.num_workers > 1 else "")
                             for name, r in asked.items())
            return (f"agents ask for {total:g} {kind} in all ({each}) but {where} has {have:g}; lower "
                    f"agents.NAME.resources.{key}{shared} (fractions such as 0.5 share a core) or num_workers, or "
                    "give the cluster more")
    return None


def bundle_of(r) -> dict[str, float]:
    """The placement bundle of one worker with resources `r` (a `ResourcesConfig`)."""
    bundle = {"CPU": r.num_cpus, **({"GPU": r.num_gpus} if r.num_gpus else {}), **r.custom}
    if r.accelerator_type:
        bundle[f"accelerator_type:{r.accelerator_type}"] = 0.001  # Ray's marker resource of a node's GPU type
    return bundle


def setting(host: str, layout: dict[str, list[str]]) -> str:
    """Where a host's resources are set: `agents.NAME.resources` (an agent's own host) or `hosts.NAME.resources`."""
    return f"agents.{host}.resources" if layout[host] == [host] else f"hosts.{host}.resources"


def unmatched_labels(resources: dict[str, Any], layout: dict[str, list[str]], nodes: list[dict[str, Any]],
                     where: str = "the Ray cluster") -> str | None:
    """Why no live node of the cluster (`nodes`: ray.nodes()) matches a host's label selector, or None."""
    alive = [n for n in nodes if n.get("Alive")]
    for host, r in resources.items():
        if r.label_selector and not any(label_matches(n.get("Labels") or {}, r.label_selector) for n in alive):
            labels = sorted({f"{k}={v}" for n in alive for k, v in (n.get("Labels") or {}).items() if k != NODE_ID_LABEL})
            agents = ("agent " if len(layout[host]) == 1 else "agents ") + ", ".join(repr(a) for a in layout[host])
            return (f"{setting(host, layout)}.label_selector {r.label_selector}: no live node of {where} has "
                    f"these labels, so {agents} cannot be placed (node labels here: {', '.join(labels) or 'none'}); "
                    "start a node with them (ray start --labels=KEY=VALUE) or change the selector")
    return None


def missing_resources(resources: dict[str, Any], layout: dict[str, list[str]], total: dict[str, float],
                      where: str = "the Ray cluster") -> str | None:
    """Why no node of the cluster (`total`: its resources) can ever hold a host's custom resource or GPU type, or None."""
    for host, r in resources.items():
        for key in bundle_of(r):
            if key not in ("CPU", "GPU") and key not in total:
                what = (f"{setting(host, layout)}.accelerator_type {key.split(':', 1)[1]!r}"
                        if key.startswith("accelerator_type:") else f"{setting(host, layout)}.custom {key!r}")
                have = sorted(k for k in total if k not in ("CPU", "GPU", "memory", "object_store_memory")
                              and not k.startswith("node:"))
                return (f"{what}: no node of {where} has it (custom resources and GPU types here: "
                        f"{', '.join(have) or 'none'}); start a node with it (ray start --resources=...) or change the setting")
    return None


def fit_problem(config: RunConfig, plan: RunPlan, total: dict[str, float], nodes: list[dict[str, Any]],
                where: str, *, node_ids_known: bool = True) -> str | None:
    """Why a cluster (`total`: its resources in all; `nodes`: as ray.nodes() lists them) can never place the
    trainers: too few CPUs or GPUs in all, a custom resource or GPU type no node has, a label selector no live
    node matches; or None. `node_ids_known=False`: selectors on a node's id are left out (a cluster not yet up)."""
    problem = placement_problem(config, plan, total.get("CPU", 0.0), total.get("GPU", 0.0), where)
    if problem:
        return problem
    layout = plan.host_layout
    resources = {host: plan.host_resources[host] for host in layout}
    if not node_ids_known:
        resources = {host: r.model_copy(update={"label_selector": {
            k: v for k, v in r.label_selector.items() if k != NODE_ID_LABEL}}) for host, r in resources.items()}
    return missing_resources(resources, layout, total, where) or unmatched_labels(resources, layout, nodes, where)


NODE_ID_LABEL = "ray.io/node-id"
"""The label Ray gives each node, its id: known only once the node runs."""


def local_cluster_problem(config: RunConfig, plan: RunPlan) -> str | None:
    """`fit_problem` for the local Ray cluster `marsi run` would start (ray.enabled, no ray.address), before it
    starts: this machine's node as Ray would make it (its CPUs and GPUs, or ray.num_cpus and ray.num_gpus; its
    GPU type; the labels Ray gives it; no custom resources). A selector on the node's id is left to the running
    cluster, and so is everything where this Ray cannot tell its node beforehand."""
    try:
        from ray._private.resource_and_label_spec import ResourceAndLabelSpec

        node = ResourceAndLabelSpec(num_cpus=config.ray.num_cpus, num_gpus=config.ray.num_gpus).resolve(
            is_head=True, node_ip_address="127.0.0.1")  # as ray.init(num_cpus=..., num_gpus=...) makes it
        total, labels = node.to_resource_dict(), dict(node.labels)
    except Exception:  # another Ray's internals: the running cluster is checked once it is up
        return placement_problem(config, plan, *local_resources(config), "the local cluster")
    return fit_problem(config, plan, total, [{"Alive": True, "Labels": labels}], "the local cluster",
                       node_ids_known=False)


def local_resources(config: RunConfig) -> tuple[float, float]:
    """CPUs and GPUs of the local Ray cluster `marsi run` would start."""
    cpus = config.ray.num_cpus if config.ray.num_cpus is not None else float(os.cpu_count() or 1)
    gpus = config.ray.num_gpus if config.ray.num_gpus is not None else float(visible_gpus())
    return cpus, gpus


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use, counted as Ray counts them without importing torch:
    CUDA_VISIBLE_DEVICES when set, else the devices the driver lists under /proc/driver/nvidia/gpus."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def num_threads(num_cpus: float) -> int:
    """torch threads for a trainer with `num_cpus` cores: one per whole core, at least one."""
    return max(1, math.floor(num_cpus))


class LocalTrainers(TrainerPool):
    """Trainers as plain objects in this process, on their hosts (adapter agents of one host share a base);
    calls run one after another."""

    def __init__(self, config: RunConfig, plan: RunPlan, updates: dict[str, int]):
        """`plan`: `config`'s (`protocols.plan`); `updates`: agent -> the updates it is scheduled for."""
        import torch

        from agent_trainer.hosts import Host

        self.set_threads = torch.set_num_threads
        self.lock = threading.Lock()
        return_freed_memory()
        self.agents = [*config.agents, *plan.critic_members]  # and the critics, served like agents
        self.critics = set(plan.critic_members)
        self.hosts: dict[str, Host] = {}  # agent or critic -> its host
        self.threads = {name: num_threads(plan.host_resources[host].num_cpus)
                        for host, names in plan.member_layout.items() for name in names}
        for host, names in plan.member_layout.items():
            self.set_threads(self.threads[names[0]])
            started = Host(host, config, plan, updates)
            self.hosts.update(dict.fromkeys(names, started))
        self.trainers = {name: host.trainers[name] for name, host in self.hosts.items()}
        self.start_info = self.info()

    def _fan_out(self, method: Callable, calls: dict[str, tuple], timeout: float | None) -> dict[str, Any]:
        declaration = declaration_of(method)  # no engine of its own in one process: nothing routed or published
        results = {}
        with self.lock:  # one call at a time, whichever thread asks (asynchronous rollouts play in their own)
            for name, args in calls.items():
                self.set_threads(self.threads[name])
                try:
                    results[name] = declaration.dispatch.collect([self.hosts[name].call(name, method, *args)])
                except Exception as exc:
                    raise TrainerFailure(name, declaration.name, describe(exc), recoverable=False) from exc
        return results

    def info(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        return {name: {"pid": os.getpid(), "device": str(t.device), "engine": getattr(t.engine, "name", None),
                       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "load_s": t.load_seconds,
                       "precision": t.precision._asdict()}
                for name, t in self.trainers.items()}

    def close(self) -> None:
        for trainer in self.trainers.values():
            trainer.close()
        self.trainers.clear()
