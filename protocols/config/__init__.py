"""The run config: strict pydantic models read from YAML, with dotted overrides.

Every model forbids unknown keys. `load_config` turns any problem into one `ConfigError` line that
names the file, the dotted key, the bad value and what is expected.

One file per part of the config, each with the checks about it: `agents` (and `hosts`), `rollout` (engines),
`cluster` (`ray`, and the resources trainers ask of it), `environment` (with `roles` and `schedule`), `algorithm`,
`critic`, `data` (and `eval`), `train` (with `logging`, and where checkpoints go); `hosts` says which process holds
which agents and critics; `run` holds `RunConfig`, `loading` reads one.
"""

from protocols.config.agents import (
    AdapterConfig, AgentConfig, GenerationConfig, HostConfig, OptimizerConfig, agents_problem,
    engine_settings_problem, workers_problem,
)
from protocols.config.algorithm import (
    GROUPED, AgentAlgorithmConfig, AlgorithmConfig, GroupBy, algorithm_problem, rotation_groups_problem,
)
from protocols.config.base import ConfigError, unknown_agent, with_field_docs
from protocols.config.cluster import RayConfig, ResourcesConfig, joins_cluster, label_matches, label_selector_problem
from protocols.config.critic import (
    CENTRAL_CRITIC, CriticConfig, critic_host_agent, critic_members, critic_problem, critic_settings,
)
from protocols.config.data import DataConfig, EvalConfig, eval_problem
from protocols.config.environment import (
    EnvironmentConfig, RolesConfig, ScheduleConfig, attempts_value_problem, roles_problem, schedule_problem,
)
from protocols.config.hosts import (
    adapter_problem, agent_resources, host_layout, host_resources, hosts_problem, member_layout,
    placement_strategy_problem,
)
from protocols.config.loading import apply_overrides, load_config, validate_config
from protocols.config.rollout import (
    RolloutConfig, VLLMConfig, EnginePriority, engine_cache_sizes, engine_priority, rollout_problem, separate_engine_problem,
    tis_cap_of,
)
from protocols.config.run import CROSS_CHECKS, RunConfig, stored_form
from protocols.config.train import STORAGE_SCHEMES, LoggingConfig, TrainConfig, credentials_problem, storage_problem

__all__ = [
    "CENTRAL_CRITIC", "CROSS_CHECKS", "GROUPED", "STORAGE_SCHEMES", "AdapterConfig", "AgentAlgorithmConfig",
    "AgentConfig", "AlgorithmConfig", "ConfigError", "CriticConfig", "DataConfig", "EnvironmentConfig", "EvalConfig",
    "GenerationConfig", "GroupBy", "HostConfig", "LoggingConfig", "OptimizerConfig", "RayConfig", "ResourcesConfig",
    "RolesConfig", "RolloutConfig", "RunConfig", "ScheduleConfig", "TrainConfig", "VLLMConfig", "adapter_problem",
    "agent_resources", "agents_problem", "algorithm_problem", "apply_overrides", "attempts_value_problem",
    "credentials_problem", "critic_host_agent", "critic_members", "critic_problem", "critic_settings", "engine_cache_sizes",
    "EnginePriority", "engine_priority", "engine_settings_problem", "eval_problem", "host_layout", "host_resources", "hosts_problem",
    "joins_cluster", "label_matches", "label_selector_problem", "load_config", "member_layout",
    "placement_strategy_problem", "roles_problem", "rollout_problem", "rotation_groups_problem", "schedule_problem",
    "separate_engine_problem", "storage_problem", "stored_form", "tis_cap_of", "unknown_agent", "validate_config",
    "workers_problem", "with_field_docs",
]
