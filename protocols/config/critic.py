"""`critic`: the learned value function of `algorithm.baseline: critic`, which critics a run has and where each
lives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from protocols.config.agents import OptimizerConfig
from protocols.config.base import _Strict
from protocols.config.cluster import ResourcesConfig

if TYPE_CHECKING:
    from protocols.config.run import RunConfig


class CriticConfig(_Strict):
    """The learned value function of `algorithm.baseline: critic`: advantages are GAE over each (agent, role)'s
    turns of an episode against its values, normalised per agent (docs/rl-maths.md). A critic is served like an
    agent (`agent_trainer/critic.py`): placed, checkpointed with the run, restored and restarted with it."""

    kind: Literal["per_agent", "central"] = "central"
    """`per_agent`: one critic per trainable agent (`critic-NAME`), seeing that agent's own prompts and answers of
    the episode (independent actor-critic). `central`: one critic (`critic`) seeing every agent's turns of the
    episode (centralised training, decentralised execution, as MAAC's critic)."""
    model: str = "builtin:tiny"
    """The value model: a small LM (`builtin:tiny`, a local path or a hub id) whose last hidden state feeds a
    scalar head, all of it trained; or `agent`: a scalar head on the hosting agent's own model (only the head
    trains, on the agent's hidden states; no second model), which needs `placement: agent`."""
    placement: Literal["own", "agent"] = "own"
    """`own`: each critic in a host (process) of its own, with `resources`. `agent`: in an agent's host: a
    per-agent critic in its agent's, the central critic in `critic.agent`'s."""
    agent: str | None = None
    """`kind: central` with `placement: agent`: the agent whose host holds the critic (and, with `model: agent`,
    whose model carries the head); None: the first agent declared."""
    resources: ResourcesConfig = ResourcesConfig(num_cpus=0.5)
    """Resources of each critic's own host (`placement: own`); one worker."""
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0)
    """GAE's lambda, per decision of an (agent, role): 1 gives the discounted return minus the value (Monte
    Carlo), 0 the one-step TD error."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """PPO's value clipping: a prediction may move at most this far from the rollout's value before its loss
    stops pulling it (the larger of the clipped and unclipped squared errors is taken); None: no clipping."""
    num_iterations: int = Field(2, ge=1)
    """Passes over each step's value targets per critic update."""
    max_length: int = Field(512, ge=8)
    """Most tokens of a critic input; a longer one loses its start (the newest turns are kept)."""
    micro_batch_size: int = Field(16, ge=1)
    """Rows per forward/backward of a critic's values and updates (states that begin another share its row)."""
    optimizer: OptimizerConfig = OptimizerConfig(lr=1e-4)
    """The critic's AdamW and learning-rate schedule (over `train.steps` updates: a critic updates every step)."""

    @model_validator(mode="after")
    def _checks(self) -> CriticConfig:
        if self.model == "agent" and self.placement != "agent":
            raise ValueError("critic.model: agent puts a value head on an agent's own model, in that agent's process; "
                             "set critic.placement: agent, or give critic.model a small LM such as builtin:tiny")
        if self.placement == "agent" and "resources" in self.model_fields_set:
            raise ValueError("critic.resources: a critic with placement agent runs on its agent's host and resources; "
                             "remove critic.resources or set critic.placement: own")
        if self.resources.num_workers > 1:
            raise ValueError(f"critic.resources.num_workers: {self.resources.num_workers}, but a critic runs on one "
                             "worker; set critic.resources.num_workers: 1")
        if self.agent is not None and not (self.kind == "central" and self.placement == "agent"):
            raise ValueError("critic.agent: names the host of a central critic with placement agent; remove it, or set "
                             "critic.kind: central and critic.placement: agent")
        return self


CENTRAL_CRITIC = "critic"
"""The name of the central critic (`critic.kind: central`); a per-agent critic is `critic-AGENT`."""


def critic_settings(config: RunConfig) -> CriticConfig | None:
    """The run's critic settings: the `critic` section, or its defaults when `algorithm.baseline: critic` comes
    without it; None without a critic."""
    if config.critic is None and config.algorithm.baseline == "critic":
        return CriticConfig()
    return config.critic


def critic_members(config: RunConfig) -> dict[str, list[str]]:
    """Critic name -> the agents whose actions it values: one per trainable agent (`per_agent`), or one for
    every agent (`central`); empty without a critic."""
    critic = critic_settings(config)
    if critic is None:
        return {}
    trainable = [a for a in config.agents if a not in config.schedule.frozen]
    if critic.kind == "central":
        return {CENTRAL_CRITIC: list(config.agents)}
    return {f"{CENTRAL_CRITIC}-{a}": [a] for a in trainable}


def critic_host_agent(config: RunConfig, critic: str) -> str | None:
    """The agent whose host holds `critic` (`placement: agent`), or None (a host of its own, named after it)."""
    settings = critic_settings(config)
    if settings.placement == "own":
        return None
    if settings.kind == "central":
        return settings.agent or next(iter(config.agents))
    return critic_members(config)[critic][0]


def critic_problem(config: RunConfig) -> str | None:
    """Why the `critic` section does not fit the run, naming the keys and the fix, or None."""
    baseline = config.algorithm.baseline
    if config.critic is not None and baseline != "critic":
        return (f"critic: given, but algorithm.baseline is {baseline!r}, which uses no critic; set "
                "algorithm.baseline: critic or remove the critic section")
    critic = critic_settings(config)
    if critic is None:
        return None
    if critic.agent is not None and critic.agent not in config.agents:
        return f"critic.agent: agent {critic.agent!r} is not defined; defined agents: {', '.join(config.agents)}"
    if config.train.max_staleness > 0:
        return (f"train.max_staleness: {config.train.max_staleness} with algorithm.baseline: critic; a critic values "
                "the episodes of the step it trains on (asynchronous rollouts are not supported with it); set "
                "train.max_staleness: 0 or algorithm.baseline: group")
    if not critic_members(config):
        return "critic.kind: per_agent gives one critic per trainable agent, and every agent is in schedule.frozen; " \
               "train an agent or set algorithm.baseline: group"
    for name in critic_members(config):
        if name in config.agents or name in config.hosts:
            return (f"agents.{name}: the name {name!r} is the critic's (critic.kind: {critic.kind}); rename the "
                    "agent or host")
        agent = critic_host_agent(config, name)
        if agent is not None and config.agents[agent].resources.num_workers > 1:
            return (f"critic.placement: agent puts {name!r} in agent {agent!r}'s host, which has "
                    f"{config.agents[agent].resources.num_workers} data-parallel workers; set critic.placement: own "
                    f"or agents.{agent}.resources.num_workers: 1")
    return None
