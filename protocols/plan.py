"""The run plan: what a run config implies about the run's processes, derived once (`plan_of`) and read
everywhere: which host holds which agents and critics, what each host asks of the cluster, each agent's
staleness bound and each vLLM engine's KV-cache size.

The config (`protocols.config`) holds the settings, each with its default; what several of them imply about the
run's processes is here, and validation fills nothing of it into the config. Where trainers start from another config than the run's (evaluation partners added, an
engine of its own), that config has a plan of its own."""

from __future__ import annotations

from dataclasses import dataclass, replace

from protocols.config import (
    CriticConfig, ResourcesConfig, RunConfig, agent_resources, critic_host_agent, critic_members, critic_settings,
    EnginePriority, engine_cache_sizes, engine_priority, host_layout, host_resources, member_layout,
)


@dataclass(frozen=True)
class RunPlan:
    host_layout: dict[str, list[str]]
    """Host name -> the agents it holds, in declaration order (`protocols.config.host_layout`)."""
    critic: CriticConfig | None
    """The critics' settings: the `critic` section, or its defaults with `algorithm.baseline: critic` and no section;
    None without a critic."""
    critic_members: dict[str, list[str]]
    """Critic name -> the agents whose actions it values; empty without a critic."""
    critic_host_agents: dict[str, str | None]
    """Critic name -> the agent whose host holds it (`critic.placement: agent`), or None (a host of its own)."""
    member_layout: dict[str, list[str]]
    """Host name -> the agents and then the critics it holds."""
    host_resources: dict[str, ResourcesConfig]
    """Host name -> what it asks of the cluster, per worker."""
    staleness_bounds: dict[str, int]
    """Agent -> K_X, how many policy versions its actions and its partners' may be behind when its update uses
    them: `agents.X.rollout.max_staleness`, else `train.max_staleness` (`orchestrator.staleness`)."""
    engine_cache_sizes: dict[str, int]
    """Agent -> the whole sequences its vLLM engine's CPU KV cache holds, for each agent sampling with vLLM
    without `kv_cache_gb` (`protocols.config.engine_cache_sizes`)."""
    engine_layout: dict[str, list[str]]
    """Host name -> its agents, for each host whose agents' rollout engine is a process of its own
    (`rollout.placement: separate`): one engine process per host, which on a shared host holds the one base and
    every agent's adapter."""
    engine_resources: dict[str, ResourcesConfig]
    """Host name (of `engine_layout`) -> what its engine process asks of the cluster: `rollout.resources`, else the
    host's per-worker resources, in one process."""
    engine_priority: dict[str, EnginePriority]
    """Host name (of `engine_layout`) -> how its engine process lowers its priority (`rollout.nice`;
    `engine_priority`)."""


def plan_of(config: RunConfig) -> RunPlan:
    """The plan of a validated run config."""
    critics = critic_members(config)
    apart = {host: agents for host, agents in host_layout(config).items()  # its agents place their engine alike
             if config.agents[agents[0]].rollout.placement == "separate"}
    engines = {host: (config.agents[agents[0]].rollout.resources or agent_resources(config, agents[0]))
               .model_copy(update={"num_workers": 1}) for host, agents in apart.items()}
    return RunPlan(
        host_layout=host_layout(config),
        critic=critic_settings(config),
        critic_members=critics,
        critic_host_agents={name: critic_host_agent(config, name) for name in critics},
        member_layout=member_layout(config),
        host_resources=host_resources(config),
        staleness_bounds={a: spec.rollout.max_staleness if spec.rollout.max_staleness is not None
                          else config.train.max_staleness for a, spec in config.agents.items()},
        engine_cache_sizes=engine_cache_sizes(config),
        engine_layout=apart,
        engine_resources=engines,
        engine_priority={host: engine_priority(config.agents[agents[0]].rollout, engines[host])
                         for host, agents in apart.items()},
    )


def with_partners(plan: RunPlan, config: RunConfig, sits_in_for: dict[str, str]) -> RunPlan:
    """The plan of the trainers' config (`config`: the run's, with evaluation partners added as frozen agents),
    each partner's engine sized as the agent it sits in for (`sits_in_for`: partner -> agent) is in `plan`."""
    own = plan_of(config)
    sizes = {**own.engine_cache_sizes, **{partner: plan.engine_cache_sizes[agent] for partner, agent in
                                          sits_in_for.items() if agent in plan.engine_cache_sizes}}
    return replace(own, engine_cache_sizes=sizes)
