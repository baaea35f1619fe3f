"""Which process holds which agents and critics (`agents.NAME.host`, `hosts`, `critic.placement`), what each
asks of the cluster, and the rules that keep a shared host together."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocols.config.critic import critic_host_agent, critic_members, critic_settings
from protocols.config.cluster import ResourcesConfig

if TYPE_CHECKING:
    from protocols.config.agents import AgentConfig
    from protocols.config.run import RunConfig


def host_layout(config: RunConfig) -> dict[str, list[str]]:
    """Host name -> the agents it holds, in declaration order: the hosts of `hosts` that agents name, then one
    host per agent without `host`, named after the agent."""
    layout: dict[str, list[str]] = {}
    for name, agent in config.agents.items():
        layout.setdefault(agent.host or name, []).append(name)
    return layout


def member_layout(config: RunConfig) -> dict[str, list[str]]:
    """Host name -> the agents and then the critics it holds: `host_layout`, with each critic in its agent's
    host (`critic.placement: agent`) or in one of its own, named after it."""
    layout = host_layout(config)
    for name in critic_members(config):
        agent = critic_host_agent(config, name)
        layout.setdefault(config.agents[agent].host or agent if agent else name, []).append(name)
    return layout


def agent_resources(config: RunConfig, name: str) -> ResourcesConfig:
    """What agent `name` runs on: its shared host's resources (`hosts.HOST.resources`) where it has `host`, else
    its own (`agents.NAME.resources`)."""
    agent = config.agents[name]
    return config.hosts[agent.host].resources if agent.host is not None else agent.resources


def host_resources(config: RunConfig) -> dict[str, ResourcesConfig]:
    """Host name -> what it asks of the cluster: its agents' resources (`agent_resources`), or a critic's own."""
    return {host: agent_resources(config, names[0]) if names[0] in config.agents else critic_settings(config).resources
            for host, names in member_layout(config).items()}


VLLM_MAX_LORA_RANK = 512
"""The largest LoRA rank a vLLM engine serves (its `max_lora_rank`)."""

_SHARED = ("model", "tokenizer", "dtype")
"""What the agents of one host must agree on: they share one base model and its tokenizer."""


def hosts_problem(config: RunConfig) -> str | None:
    """Why the agents' hosts do not hold together, naming the keys and the fix, or None."""
    for name, agent in config.agents.items():
        if problem := adapter_problem(name, agent):
            return problem
        if agent.host is None:
            if name in config.hosts:
                return (f"hosts.{name}: a host may not take the name of agent {name!r}, which has no "
                        f"agents.{name}.host; rename the host or set agents.{name}.host: {name}")
            continue
        if agent.host not in config.hosts:
            return (f"agents.{name}.host: host {agent.host!r} is not defined; defined hosts: "
                    f"{', '.join(config.hosts) or '(none)'}; add hosts.{agent.host}: {{resources: ...}}")
        if "resources" in agent.model_fields_set and agent.resources != config.hosts[agent.host].resources:
            return (f"agents.{name}.resources: agent {name!r} lives on host {agent.host!r}, whose resources are "
                    f"hosts.{agent.host}.resources; remove agents.{name}.resources")
    for host, spec in config.hosts.items():
        if spec.resources.num_workers > 1:
            return (f"hosts.{host}.resources.num_workers: {spec.resources.num_workers}, but a shared host runs on one "
                    f"worker; set hosts.{host}.resources.num_workers: 1 (give a full-model agent of its own host "
                    "more workers instead)")
    layout = host_layout(config)
    for host in config.hosts:
        if host not in layout:
            return f"hosts.{host}: no agent names this host (agents.NAME.host: {host}); remove it or place agents on it"
    for host, names in layout.items():
        if len(names) < 2:
            continue
        plain = [n for n in names if config.agents[n].adapter is None]
        if plain:
            return (f"agents.{plain[0]}.adapter: agents on host {host!r} ({', '.join(names)}) share one base model, so "
                    f"each needs an adapter; give agents.{plain[0]}.adapter, or a host of its own (remove "
                    f"agents.{plain[0]}.host)")
        first = config.agents[names[0]]
        for other in names[1:]:
            for key in _SHARED:
                mine, theirs = getattr(first, key), getattr(config.agents[other], key)
                if mine != theirs:
                    return (f"agents.{other}.{key}: {theirs!r} differs from agents.{names[0]}.{key} {mine!r}, and both "
                            f"live on host {host!r}, which holds one base model; make them equal or put "
                            f"{other!r} on another host")
    return None


def adapter_problem(name: str, agent: AgentConfig) -> str | None:
    """Why agent `name`'s adapter cannot be as set (with vLLM's sleep mode or above vLLM's largest rank, beside a
    saved adapter's own settings, on several workers, under a dotted name), naming the keys and the fix, or None."""
    vllm = agent.adapter is not None and agent.rollout.engine == "vllm"
    if vllm and agent.rollout.vllm.sleep_mode:
        return (f"agents.{name}.rollout.vllm.sleep_mode: an adapter agent's vllm engine keeps its base through the "
                f"updates (only the adapter is sent again), so it cannot discard its weights; set "
                f"agents.{name}.rollout.vllm.sleep_mode: false")
    if vllm and agent.adapter.rank > VLLM_MAX_LORA_RANK:
        return (f"agents.{name}.adapter.rank: {agent.adapter.rank}, but the vllm engine serves LoRA ranks up to "
                f"{VLLM_MAX_LORA_RANK}; lower agents.{name}.adapter.rank or set agents.{name}.rollout.engine: hf")
    if agent.adapter is not None and agent.adapter.path is not None and agent.adapter.overridden():
        given = agent.adapter.overridden()
        return (f"agents.{name}.adapter.{given[0]}: the adapter at agents.{name}.adapter.path has its own settings; "
                f"remove {', '.join(f'agents.{name}.adapter.{g}' for g in given)} or agents.{name}.adapter.path")
    if agent.adapter is not None and agent.resources.num_workers > 1:
        return (f"agents.{name}.resources.num_workers: {agent.resources.num_workers}, but an adapter agent runs on "
                f"one worker (its host may hold other agents' adapters); set agents.{name}.resources.num_workers: 1 "
                f"or remove agents.{name}.adapter")
    if agent.adapter is not None and "." in name:
        return (f"agents.{name}: an adapter agent's name may not contain '.' (its adapter is a module named after "
                "it); rename the agent")
    return None


def placement_strategy_problem(config: RunConfig) -> str | None:
    """Why an agent's or host's own placement strategy cannot sit beside `ray.placement_strategy`, or None."""
    own = [f"{section}.{name}" for section, specs in (("agents", config.agents), ("hosts", config.hosts))
           for name, spec in specs.items() if spec.resources.placement_strategy is not None]
    if own and config.ray.placement_strategy.startswith("STRICT_"):
        return (f"ray.placement_strategy: {config.ray.placement_strategy} holds all trainers as one group, but "
                f"{own[0]}.resources.placement_strategy places that agent's workers as a group of their own; "
                f"set ray.placement_strategy to PACK or SPREAD, or remove {own[0]}.resources.placement_strategy")
    return None
