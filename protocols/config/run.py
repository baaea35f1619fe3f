"""`RunConfig`, the whole run config: its sections, and the checks that need several of them, run in a fixed
order so that a config with several problems is always told the same one first."""

from __future__ import annotations

from pydantic import model_validator

from protocols.config.agents import AgentConfig, HostConfig, agents_problem
from protocols.config.algorithm import AlgorithmConfig, algorithm_problem, rotation_groups_problem
from protocols.config.base import _Strict
from protocols.config.cluster import RayConfig
from protocols.config.critic import CriticConfig, critic_problem
from protocols.config.data import DataConfig, EvalConfig, eval_problem
from protocols.config.environment import (
    EnvironmentConfig, RolesConfig, ScheduleConfig, roles_problem, schedule_problem,
)
from protocols.config.hosts import hosts_problem, placement_strategy_problem
from protocols.config.train import LoggingConfig, TrainConfig


class RunConfig(_Strict):
    agents: dict[str, AgentConfig]
    """Agent name -> its model, sampling, optimizer and resources."""
    environment: EnvironmentConfig
    """The turn-based environment."""
    roles: RolesConfig
    """Which agent plays which role, and how that rotates."""
    data: DataConfig
    """The task samples each episode starts from."""
    schedule: ScheduleConfig = ScheduleConfig()
    """Which agents update at which step."""
    algorithm: AlgorithmConfig = AlgorithmConfig()
    """Returns, advantages and the loss."""
    train: TrainConfig = TrainConfig()
    """Steps, batch, seed, checkpoints, run directory."""
    logging: LoggingConfig = LoggingConfig()
    """Optional metric sinks."""
    ray: RayConfig = RayConfig()
    """Ray cluster settings."""
    eval: EvalConfig | None = None
    """Held-out evaluation during the run and for `marsi eval`; None: none."""
    hosts: dict[str, HostConfig] = {}
    """Host name -> its resources: processes that several adapter agents share (`agents.NAME.host`)."""
    critic: CriticConfig | None = None
    """The learned value function of `algorithm.baseline: critic`; None: its defaults with that baseline
    (`critic_settings`), none otherwise."""

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        for check in CROSS_CHECKS:
            problem = check(self)
            if problem:
                raise ValueError(problem)
        return self


CROSS_CHECKS = (agents_problem, hosts_problem, placement_strategy_problem, roles_problem, schedule_problem,
                algorithm_problem, critic_problem, eval_problem, rotation_groups_problem)
"""The checks that need several sections, each beside the section it is about, in the order they are made."""


def stored_form(config: RunConfig) -> dict:
    """The config as a run directory stores it (config.yaml), which validates back to `config`: every setting
    written out, its defaults too, so that a resumed run keeps them; an agent on a shared host leaves out its
    `resources` unless they were given (it runs on `hosts.HOST.resources`)."""
    raw = config.model_dump(mode="json")
    for name, agent in config.agents.items():
        if agent.host is not None and "resources" not in agent.model_fields_set:
            del raw["agents"][name]["resources"]
    return raw
