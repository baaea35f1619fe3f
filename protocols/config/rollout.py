"""`agents.NAME.rollout`: the engine that samples an agent's completions (hf, or a vLLM engine and its KV cache),
where it runs, and how stale its actions may be."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from protocols.config.base import _Strict
from protocols.config.cluster import ResourcesConfig

if TYPE_CHECKING:
    from protocols.config.agents import AgentConfig
    from protocols.config.run import RunConfig


class VLLMConfig(_Strict):
    """Settings of a colocated vLLM engine (`rollout.engine: vllm`); see README, "Rollout engines"."""

    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0)
    """On a GPU: the share of the GPU's memory the engine may take (weights, activations, KV cache); the learner
    needs the rest. Ignored on CPU, where `kv_cache_gb` sizes the engine."""
    kv_cache_gb: float | None = Field(None, gt=0.0)
    """KV-cache size in GiB. None: on CPU, sized to the run (`kv_cache_sequences` sequences of
    generation.max_prompt_length + max_completion_length tokens, each rounded up to whole 128-token blocks plus
    one; bytes per token from the model's config: layers x 2 x key/value heads x head dim x dtype size); on a GPU,
    what `gpu_memory_utilization` leaves after the weights."""
    kv_cache_sequences: int | None = Field(None, ge=1)
    """On CPU without `kv_cache_gb`: how many whole sequences the KV cache holds. None: sized to the run
    (`engine_cache_sizes`, in the run's plan), train.batch_size x train.num_generations x the most roles this agent
    holds in one seating, a role counted k times with `roles.attempts` (the most rows one of its generate calls
    has; an environment's own attempts are not seen there), capped at `max_num_seqs`; an agent used without a run
    config (a plain AgentTrainer) gets `max_num_seqs`."""
    max_num_seqs: int = Field(64, ge=1)
    """Most sequences the engine decodes at once; a larger batch waits for a free slot."""
    enforce_eager: bool = True
    """Run the model eagerly (no torch.compile, no CUDA graphs): seconds to start instead of minutes; False is
    faster per token on a GPU once compiled."""
    sleep_mode: bool = False
    """GPU only: the engine frees its GPU memory (KV cache and weights) during each update and wakes with the
    new weights, so engine and learner share one GPU. Needs resources.num_gpus > 0."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """The engine's weight dtype; None: the agent's `dtype`, as the agent's trainer resolved it (`auto` follows the
    same rule for the engine as for the learner). bfloat16 halves the engine's memory on a GPU; the update's
    importance weights (`tis_cap`) correct for the larger log-prob gap it brings."""


class RolloutConfig(_Strict):
    engine: Literal["hf", "vllm"] = "hf"
    """What samples the agent's completions: `hf`, marsi's own decode loop on the learner's model (no copy of the
    weights, no sync); `vllm`, a vLLM engine colocated in the agent's trainer, holding its own copy of the
    weights, synced after every update (needs the `vllm` extra)."""
    vllm: VLLMConfig | None = None
    """vLLM engine settings (engine: vllm); None: the defaults."""
    tis_cap: float | Literal["auto"] | None = "auto"
    """Truncated importance sampling: every token's policy-gradient term is weighted by
    min(exp(trainer log-prob - behaviour log-prob), tis_cap), the trainer's log-prob taken before the update,
    correcting for an engine whose log-probs differ from the trainer's, or for actions drawn by an older policy
    version (asynchronous rollouts). `auto`: 2.0 with engine vllm or with actions that may be stale (this agent's
    `max_staleness`, else `train.max_staleness`, above 0), else off (hf's behaviour log-probs come from the
    learner's own model; `tis_cap_of`). None: off."""

    placement: Literal["colocated", "separate"] = "colocated"
    """Where the engine samples: `colocated`, in the agent's trainer process (the learner's weights, or beside them);
    `separate`, in a Ray actor of its own with its own copy of the weights (`resources`), which takes each policy
    version of the learner's when a generate asks for it (`weight_transfer`), so that with
    `train.max_staleness` > 0 it generates the next rollouts while its own learner updates. Needs Ray; either
    engine (`hf`, `vllm`). An adapter agent's engine holds the base and takes only the adapter's weights; the
    agents of a shared host place their engine alike and get one engine apart for all their adapters. A
    data-parallel agent's engine is one process, fed by worker 0, that samples every worker's rows; its learner
    workers hold no engine of their own (and so a `vllm` agent may have several workers)."""
    resources: ResourcesConfig | None = None
    """`placement: separate`: the engine actor's CPUs and GPUs; None: the same as the agent's `resources`."""
    weight_transfer: Literal["group", "store"] = "group"
    """`placement: separate`: how the engine takes its learner's weights. `group`: a torch.distributed group of the
    two processes (gloo on CPU, NCCL on GPU), the learner broadcasting its live tensors into the engine's, in
    buckets; Ray's object store where no group can be formed (said at start). The engine then holds one version at
    a time, so with `train.max_staleness` above 1 an update waits for the rollouts that draw with the weights before
    it. `store`: each version the learner publishes, through Ray's object store."""
    nice: int | Literal["auto", "idle"] = "auto"
    """`placement: separate`: how the engine process yields the cores it shares with its learner, whose update is
    the step's critical path while the engine plays later steps (`agent_trainer.priority`). An integer 0 to 19: the
    niceness it adds to its own as it starts (the system caps niceness at 19, and Ray starts its workers at 15, its
    `worker_niceness`, so there the engine ends at most 4 above its learner). `idle`: Linux's idle scheduling
    class, in which it runs only on cores no other process wants. `auto`: `idle` for an engine without a GPU, 0
    with one (`engine_priority`). The start line gives both processes' priority."""
    max_staleness: int | None = Field(None, ge=0)
    """Most policy versions this agent's actions (and its partners' in the same episode) may be behind their
    learners when this agent's update uses them; staler ones are dropped and counted (`staleness/NAME/dropped`).
    None: `train.max_staleness`. At most `train.max_staleness`, which sets how far rollouts run ahead (see
    docs/roles-and-schedules.md, "Asynchronous rollouts")."""

    @field_validator("tis_cap", mode="before")
    @classmethod
    def _tis_cap(cls, value):
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("Input should be a number of at least 1, auto or null")
        if not value >= 1.0:
            raise ValueError("Input should be greater than or equal to 1")
        return float(value)

    @field_validator("nice", mode="before")
    @classmethod
    def _nice(cls, value):
        if value in ("auto", "idle"):
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
            raise ValueError("Input should be an integer from 0 to 19, auto or idle")
        return value

    @model_validator(mode="after")
    def _engine_defaults(self) -> RolloutConfig:
        if self.engine == "vllm":
            if self.vllm is None:
                self.vllm = VLLMConfig()
        return self


def separate_engine_problem(name: str, agent: AgentConfig, ray_enabled: bool) -> str | None:
    """Why agent `name`'s `rollout.placement: separate` cannot be, naming the key and the fix, or None."""
    rollout = agent.rollout
    if rollout.placement != "separate":
        if rollout.resources is not None:
            return (f"agents.{name}.rollout.resources: engine resources are given but agents.{name}.rollout.placement "
                    f"is 'colocated' (the engine shares the trainer's); set agents.{name}.rollout.placement: separate "
                    f"or remove agents.{name}.rollout.resources")
        if rollout.weight_transfer != "group":  # a saved config spells out the default
            return (f"agents.{name}.rollout.weight_transfer: {rollout.weight_transfer} is how an engine of its own takes "
                    f"the weights, but agents.{name}.rollout.placement is 'colocated' (the engine shares the trainer's); "
                    f"set agents.{name}.rollout.placement: separate or remove agents.{name}.rollout.weight_transfer")
        if rollout.nice != "auto":
            return (f"agents.{name}.rollout.nice: {rollout.nice} is the niceness of an engine of its own, but "
                    f"agents.{name}.rollout.placement is 'colocated' (the engine runs in the trainer's process); set "
                    f"agents.{name}.rollout.placement: separate or remove agents.{name}.rollout.nice")
        return None
    key = f"agents.{name}.rollout.placement: separate"
    if not ray_enabled:
        return f"{key} runs the engine in a process of its own, which needs Ray, but ray.enabled is false; set ray.enabled: true or placement: colocated"
    if rollout.resources is not None and rollout.resources.num_workers > 1:
        return (f"agents.{name}.rollout.resources.num_workers: {rollout.resources.num_workers}, but an engine of its "
                f"own is one process (it samples every worker's rows); set agents.{name}.rollout.resources.num_workers: 1")
    return None


def rollout_problem(name: str, agent: AgentConfig, config: RunConfig) -> str | None:
    """Why agent `name`'s rollout does not fit the run (an engine apart it cannot have, a staleness bound above the
    run's), naming the keys and the fix, or None."""
    if problem := separate_engine_problem(name, agent, config.ray.enabled):
        return problem
    if problem := host_engine_problem(name, agent, config):
        return problem
    own = agent.rollout.max_staleness
    if own is not None and own > config.train.max_staleness:
        return (f"agents.{name}.rollout.max_staleness: {own} is above train.max_staleness "
                f"{config.train.max_staleness}, which sets how far rollouts run ahead, so no action is "
                f"ever that stale and it would change nothing; lower it, or raise train.max_staleness")
    return None


def tis_cap_of(rollout: RolloutConfig, staleness_bound: int) -> float | None:
    """The truncation cap an agent's update uses: its `rollout.tis_cap`, with `auto` resolved from its engine and
    its staleness bound (`protocols.plan.RunPlan.staleness_bounds`); None: no importance weights."""
    if rollout.tis_cap != "auto":
        return rollout.tis_cap
    return 2.0 if rollout.engine == "vllm" or staleness_bound > 0 else None


def engine_cache_sizes(config: RunConfig) -> dict[str, int]:
    """Agent -> the whole sequences its vLLM engine's CPU KV cache holds, for each agent sampling with vLLM
    without `kv_cache_gb`: `kv_cache_sequences` where given, else the rows of its largest generate call
    (train.batch_size x train.num_generations x the most roles it holds in one seating, a role counted k times
    with `roles.attempts`), at most `max_num_seqs`; the agents of a shared host share one engine, which holds the
    most any of them needs."""
    sizes = {}
    for name, agent in config.agents.items():
        settings = agent.rollout.vllm
        if agent.rollout.engine != "vllm" or settings.kv_cache_gb is not None:
            continue
        seats = max([sum(config.roles.attempts.get(r, 1) for r, a in seating.items() if a == name)
                     for seating in config.roles.seatings()] or [1])
        rows = config.train.batch_size * config.train.num_generations * max(1, seats)
        sizes[name] = settings.kv_cache_sequences or min(rows, settings.max_num_seqs)
    for name, agent in config.agents.items():  # a shared host's agents sample in one engine, one call at a time
        if name in sizes and agent.host is not None:
            sizes[name] = max(sizes.get(a, 0) for a, other in config.agents.items() if other.host == agent.host)
    return sizes


_ONE_ENGINE = ("engine", "vllm", "placement", "resources", "weight_transfer", "nice")
"""What the agents of one host must agree on about their rollout: they sample in one engine (one base, each agent's
adapter), in their host's process or in one apart."""


def host_engine_problem(name: str, agent: AgentConfig, config: RunConfig) -> str | None:
    """Why agent `name`, on a shared host, cannot sample as its housemates do, naming the key and the fix, or None:
    the agents of a host sample in one process, their trainer's or one engine apart (one base, each agent's
    adapter), so they place it alike."""
    if agent.host is None:
        return None
    first = next(n for n, a in config.agents.items() if a.host == agent.host)
    if first == name:
        return None
    for key in _ONE_ENGINE:
        mine, theirs = getattr(agent.rollout, key), getattr(config.agents[first].rollout, key)
        if mine != theirs:
            return (f"agents.{name}.rollout.{key}: {_shown(mine)!r} differs from agents.{first}.rollout.{key} "
                    f"{_shown(theirs)!r}, and both live on host {agent.host!r}, whose agents sample in one engine "
                    f"(one base, each agent's adapter); make them equal")
    return None


def _shown(value):
    """A setting as a config writes it."""
    return value.model_dump(exclude_defaults=True) if hasattr(value, "model_dump") else value


@dataclass(frozen=True)
class EnginePriority:
    """How an engine apart lowers its process's priority as it starts (`agent_trainer.priority.lower`)."""

    niceness: int = 0
    """Added to the process's niceness (the system caps it at 19)."""
    idle: bool = False
    """Linux's idle scheduling class (SCHED_IDLE)."""


def engine_priority(rollout: RolloutConfig, resources: ResourcesConfig) -> EnginePriority:
    """How an engine apart with `resources` (`RunPlan.engine_resources`) lowers its priority: `rollout.nice`, where
    `auto` is `idle` on CPU and nothing with a GPU."""
    nice = rollout.nice if rollout.nice != "auto" else "idle" if resources.num_gpus == 0 else 0
    return EnginePriority(idle=True) if nice == "idle" else EnginePriority(niceness=nice)
