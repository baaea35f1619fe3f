"""`ray`: the Ray cluster the trainers run on, and what their processes are given."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from protocols.config.base import _Strict
from protocols.local_checks import forward_env_name_problem


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
