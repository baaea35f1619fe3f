"""The cluster: `ray` (the Ray cluster the trainers run on, and what their processes are given), and
`agents.NAME.resources` (and a host's, a critic's, an engine's): what one trainer asks of it, with Ray's node label
selectors."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from protocols.config.base import _Strict
from protocols.local_checks import forward_env_name_problem


class ResourcesConfig(_Strict):
    """What one agent's trainer asks of the cluster. `num_gpus` and `num_cpus` are per worker: an agent with
    `num_workers: K` asks for K times them, as K bundles of the trainers' placement group."""

    num_gpus: float = Field(0.0, ge=0.0)
    """GPUs for each of this agent's workers (Ray actors); 0 runs them on CPU."""
    num_cpus: float = Field(1.0, gt=0.0)
    """CPU cores for each worker; torch's thread count is set to max(1, floor(num_cpus))."""
    num_workers: int = Field(1, ge=1)
    """Data-parallel workers of this agent: K processes joined into one torch.distributed group (gloo on CPU,
    NCCL on GPU), each with a full copy of the model; generate requests are split across them and each update
    trains every worker on its share of the batch with the whole batch's gradient. Needs Ray (ray.enabled)."""
    custom: dict[str, float] = {}
    """Custom Ray resources for each worker, e.g. {big_node: 1} to pin the agent to nodes started with
    `ray start --resources='{"big_node": 1}'`; part of the worker's placement bundle and actor options."""
    accelerator_type: str | None = None
    """The GPU type each worker needs (Ray's accelerator types, e.g. A100, H100, L4): only nodes that report it
    host the agent. None: any."""
    label_selector: dict[str, str] = {}
    """Node labels each worker's node must have (Ray's label selector): {zone: us-east-1a} for nodes started with
    `ray start --labels=zone=us-east-1a`; a value may be `v`, `!v` (not v), `in(v1,v2)` or `!in(v1,v2)`; Ray's
    own labels work too (`ray.io/node-id`, `ray.io/accelerator-type`). Part of the worker's placement bundle; a
    selector no live node matches is refused at start. Empty: any node."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = None
    """How this agent's (or host's) workers spread over nodes, Ray's strategies as in `ray.placement_strategy`:
    `STRICT_PACK` keeps a data-parallel agent's workers on one node, `STRICT_SPREAD` puts each on a node of its
    own. Set on any agent, each agent's workers form a placement group of their own, placed by this strategy or,
    where it is None, by `ray.placement_strategy`; None on every agent: one group holds all trainers."""

    @field_validator("custom")
    @classmethod
    def _custom(cls, value: dict[str, float]) -> dict[str, float]:
        for key, amount in value.items():
            if key in ("CPU", "GPU", "memory", "object_store_memory") or key.startswith("accelerator_type:"):
                raise ValueError(f"custom: {key!r} is not a custom resource; use num_cpus, num_gpus or "
                                 "accelerator_type for it")
            if amount <= 0:
                raise ValueError(f"custom: {key}: {amount:g}; give an amount > 0")
        return value

    @field_validator("label_selector")
    @classmethod
    def _label_selector(cls, value: dict[str, str]) -> dict[str, str]:
        for key, wanted in value.items():
            problem = label_selector_problem(key, wanted)
            if problem:
                raise ValueError(problem)
        return value


_LABEL = r"[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
"""A node label's name or value (Kubernetes' syntax, which Ray follows)."""


def label_selector_problem(key: str, wanted: str) -> str | None:
    """Why `key: wanted` is not a Ray label selector entry, or None."""
    import re

    prefix, _, name = key.rpartition("/")
    if (prefix and not re.fullmatch(rf"{_LABEL}(\.{_LABEL})*", prefix)) or not re.fullmatch(_LABEL, name):
        return (f"{key!r} is not a node label name (letters, digits, '-', '_', '.', at most 63, optionally after a "
                "DNS prefix and '/')")
    if not re.fullmatch(rf"!?{_LABEL}|!?in\({_LABEL}(, ?{_LABEL})*\)", wanted):
        return f"{key}: {wanted!r}; give a label value v, !v, in(v1,v2) or !in(v1,v2)"
    return None


def label_matches(labels: dict[str, str], selector: dict[str, str]) -> bool:
    """Whether a node with `labels` satisfies `selector` (Ray's rules: `!` matches a node without the label)."""
    for key, wanted in selector.items():
        negated = wanted.startswith("!")
        wanted = wanted.removeprefix("!")
        values = {v.strip() for v in wanted[3:-1].split(",")} if wanted.startswith("in(") else {wanted}
        if (labels.get(key) in values) == negated:
            return False
    return True


class RayConfig(_Strict):
    enabled: bool = True
    """False: trainers run in-process, same results for the same seed."""
    address: str | None = None
    """Join this cluster; None: `RAY_ADDRESS`, else start a local one."""
    num_cpus: float | None = None
    """CPUs of a local cluster; None: Ray's default."""
    num_gpus: int | None = None
    """GPUs of a local cluster; None: Ray's default."""
    placement_timeout_s: float = Field(60.0, gt=0.0)
    """Seconds to wait for the trainers' placement group."""
    env_vars: dict[str, str] = {}
    """Environment variables set in every trainer process (Ray's `runtime_env`), e.g. {AWS_REGION: eu-west-1}.
    They are written to config.yaml and the store like every setting: give secrets with `forward_env` instead."""
    forward_env: list[str] = []
    """Names of environment variables copied from the coordinator's environment into every trainer process when
    the trainers start, e.g. [AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN]: storage credentials
    that only the shell that runs marsi has. Their values are written nowhere; a name not set there is an error
    at start."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How the trainers' placement group spreads them over a cluster's nodes (Ray's strategies): `PACK` as few
    nodes as possible; `SPREAD` over nodes where it can; `STRICT_PACK` one node; `STRICT_SPREAD` each trainer on
    a node of its own (fails without enough nodes)."""

    @field_validator("forward_env")
    @classmethod
    def _forward_env(cls, value: list[str]) -> list[str]:
        for name in value:
            problem = forward_env_name_problem(name)
            if problem:
                raise ValueError(problem)
        return value


def joins_cluster(config: RayConfig) -> bool:
    """Whether the trainers run on a Ray cluster marsi joins (`ray.address` or RAY_ADDRESS), possibly on
    other machines: then local model paths are checked on the node that hosts each agent, not here."""
    return config.enabled and bool(config.address or os.environ.get("RAY_ADDRESS"))
