"""A set of named trainers behind one call interface; `LocalTrainers` runs them in this process."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from agent_trainer.trainer import AgentTrainer
from protocols.config import RunConfig


def num_threads(num_cpus: float) -> int:
    """torch threads for a trainer with `num_cpus` cores: one per whole core, at least one."""
    return max(1, math.floor(num_cpus))


class LocalTrainers:
    """Trainers as plain objects in this process; calls run one after another."""

    def __init__(self, config: RunConfig, updates: dict[str, int]):
        self.trainers = {}
        self.threads = {name: num_threads(agent.resources.num_cpus) for name, agent in config.agents.items()}
        for i, (name, agent) in enumerate(config.agents.items()):
            torch.set_num_threads(self.threads[name])
            self.trainers[name] = AgentTrainer(name, agent, config.algorithm, seed=config.train.seed + i,
                                               total_updates=updates[name])

    def call(self, method: str, kwargs_by_agent: dict[str, dict[str, Any]], timeout: float | None = None) -> dict:
        results = {}
        for name, kwargs in kwargs_by_agent.items():
            torch.set_num_threads(self.threads[name])
            results[name] = getattr(self.trainers[name], method)(**kwargs)
        return results

    def info(self) -> dict[str, dict[str, Any]]:
        return {name: {"pid": os.getpid(), "device": str(t.device),
                       "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
                for name, t in self.trainers.items()}

    def close(self) -> None:
        self.trainers.clear()
