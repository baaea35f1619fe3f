"""`algorithm`: returns, baselines and advantage groups (the run's and each agent's own), and the loss."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from protocols.config.base import _Strict, unknown_agent

if TYPE_CHECKING:
    from protocols.config.run import RunConfig


GroupBy = Literal["agent_role_turn", "agent_role", "agent_turn", "agent"]
GROUPED = ("group", "rloo")
"""Baselines that compare the returns of a group (`train.num_generations` episodes of a sample)."""


class AgentAlgorithmConfig(_Strict):
    """One agent's own advantage settings (`algorithm.agents.NAME`); a setting left out is the run's (`algorithm`)."""

    baseline: Literal["group", "ema", "rloo"] | None = None
    """This agent's baseline: `group`, `ema` or `rloo`; None: algorithm.baseline."""
    group_by: GroupBy | None = None
    """Which of this agent's actions of one sample's episodes are compared; None: algorithm.group_by."""
    scale_rewards: bool | None = None
    """Divide this agent's group-relative advantages by the group's std; None: algorithm.scale_rewards."""


class AlgorithmConfig(_Strict):
    discount: float = Field(1.0, ge=0.0, le=1.0)
    """Return of turn t: sum over k >= t of discount**(k - t) * reward_k."""
    baseline: Literal["group", "ema", "rloo", "critic"] = "group"
    """`group`: minus the group mean (GRPO). `ema`: minus an EMA of returns per (agent, role, turn) (SPIRAL's RAE).
    `rloo`: minus the mean of the other returns of the group (leave-one-out, Ahmadian et al. 2024).
    `critic`: GAE over turns against a learned value function (the `critic` section; docs/rl-maths.md)."""
    group_by: GroupBy = "agent_role_turn"
    """Which actions of one sample's episodes are compared: same agent, role and turn (like with like), or the
    wider pools `agent_role` (all turns of a role), `agent_turn` (all roles at a turn), `agent` (everything). The
    k > 1 attempts of a role at one prompt (`roles.attempts`) are always a group of their own, whatever this says."""
    scale_rewards: bool = True
    """Divide group-relative advantages by the group's std (GRPO); False: Dr. GRPO."""
    ema_decay: float = Field(0.95, ge=0.0, lt=1.0)
    """Decay of the per-(agent, role, turn) EMA baseline, per return folded in."""
    beta: float = Field(0.0, ge=0.0)
    """Weight of the k3 KL to the frozen initial model; 0 loads no reference model."""
    epsilon: float = Field(0.2, gt=0.0)
    """Clip range of the importance ratio."""
    num_iterations: int = Field(1, ge=1)
    """Passes over each batch of experiences per update (PPO epochs)."""
    loss_aggregation: Literal["token", "sequence"] = "token"
    """`token`: mean over all completion tokens of the batch (DAPO). `sequence`: mean per sequence, then over sequences (GRPO)."""
    agents: dict[str, AgentAlgorithmConfig] = {}
    """Agent name -> its own `baseline`, `group_by`, `scale_rewards` (e.g. a proposer on `ema` beside a solver on
    `group`); the settings it leaves out, and every agent not named, follow the run's."""

    def for_agent(self, agent: str) -> AlgorithmConfig:
        """These settings with `agents[agent]`'s own applied."""
        own = self.agents.get(agent)
        return self if own is None else self.model_copy(update=own.model_dump(exclude_none=True))


def algorithm_problem(config: RunConfig) -> str | None:
    """Why the agents' own algorithm settings or the run's groups do not fit the run, naming the keys and the fix,
    or None."""
    algorithm = config.algorithm
    if problem := unknown_agent("algorithm.agents", list(algorithm.agents), config.agents):
        return problem
    if algorithm.agents and algorithm.baseline == "critic":
        return (f"algorithm.agents: {', '.join(algorithm.agents)} set their own baseline or groups, "
                "but with algorithm.baseline: critic every agent's credit comes from the critic; remove "
                "algorithm.agents or set algorithm.baseline: group or ema")
    grouped = any(algorithm.for_agent(a).baseline in GROUPED for a in config.agents)
    if grouped and config.train.num_generations < 2:
        return (f"train.num_generations: group-relative advantages need at least 2 episodes per group "
                f"(got {config.train.num_generations}); set train.num_generations >= 2 or algorithm.baseline=ema")
    return None


def rotation_groups_problem(config: RunConfig) -> str | None:
    """Why rotating seats every episode leaves an (agent, role) group of a sample fewer than 2 episodes, naming the
    keys and the fix, or None."""
    distinct = len({tuple(sorted(seating.items())) for seating in config.roles.seatings()})
    if (config.algorithm.baseline in GROUPED and config.roles.rotation == "per_episode" and distinct > 1
            and "role" in config.algorithm.group_by and config.train.num_generations // distinct < 2):
        return (f"train.num_generations: with roles.rotation per_episode over {distinct} seatings, each (agent, role) "
                f"group of a sample gets num_generations / {distinct} episodes, fewer than 2 with "
                f"num_generations={config.train.num_generations}; set train.num_generations to a multiple of "
                f"{distinct} that is at least {2 * distinct}")
    return None
