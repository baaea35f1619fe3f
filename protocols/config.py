"""The run config: strict pydantic models read from YAML, with dotted overrides.

Every model forbids unknown keys. `load_config` turns any problem into one `ConfigError` line that
names the file, the dotted key, the bad value and what is expected.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from protocols.errors import UserError
from protocols.imports import ImportPathError, absolute_spec, import_object
from protocols.local_checks import forward_env_name_problem, forward_env_problem, model_source


class ConfigError(UserError, ValueError):
    """A user error in a run config; its message is one line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls.__doc__ = with_field_docs(cls)


def with_field_docs(model: type[BaseModel]) -> str:
    """The model's docstring followed by one line per field and its own docstring, so help() shows them."""
    lines = [f"    {name}: {field.description}" for name, field in model.model_fields.items() if field.description]
    head = (model.__doc__ or model.__name__).rstrip()
    return head + ("\n\nFields:\n" + "\n".join(lines) if lines else "")


# ---------------------------------------------------------------------------------------- agents
class GenerationConfig(_Strict):
    max_completion_length: int = Field(32, ge=1)
    """Most new tokens per completion."""
    max_prompt_length: int = Field(512, ge=1)
    """Prompts longer than this are cut from the left (the start), and reported as truncated."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; log-probs are computed at the same temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; log-probs (behaviour and trained) are those of the truncated, renormalised distribution."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens (applied before top_p); 0 disables."""
    use_chat_template: bool | None = None
    """Wrap prompts in the tokenizer's chat template; None: when the tokenizer has one."""


class OptimizerConfig(_Strict):
    lr: float = Field(1e-5, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this; None disables clipping."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warm-up, over the agent's scheduled updates."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up updates."""
    offload: Literal["auto", "off"] = "auto"
    """Where the schedule leaves this agent without an update at the next step, release its AdamW state (to a
    temporary file on CPU, to pinned CPU memory from a GPU) and fetch it back in the background
    during the step before its next update. `auto`: so wherever the schedule (alternate, round_robin, pattern)
    leaves steps without its update; `off`: the state stays resident. Updates, metrics and checkpoints are the
    same either way; `marsi validate` prints the plan (docs/roles-and-schedules.md, "Optimizer memory")."""

    @field_validator("offload", mode="before")
    @classmethod
    def _offload_from_yaml(cls, value: Any) -> Any:
        """YAML reads a bare `off` as false (and `on` as true, which is `auto`)."""
        return ("auto" if value else "off") if isinstance(value, bool) else value


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
    """On CPU without `kv_cache_gb`: how many whole sequences the KV cache holds. None: filled in when the run
    config is read, train.batch_size x train.num_generations x the most roles this agent holds in one seating, a
    role counted k times with `roles.attempts` (the most rows one of its generate calls has; an environment's own
    attempts are not seen there), capped at `max_num_seqs`; an agent used without a run config
    (a plain AgentTrainer) gets `max_num_seqs`."""
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
    tis_cap: float | None = Field(None, ge=1.0)
    """Truncated importance sampling: every token's policy-gradient term is weighted by
    min(exp(trainer log-prob - behaviour log-prob), tis_cap), the trainer's log-prob taken before the update,
    correcting for an engine whose log-probs differ from the trainer's, or for actions drawn by an older policy
    version (asynchronous rollouts). Unset: 2.0 with engine vllm or a max_staleness above 0, else off (hf's
    behaviour log-probs come from the learner's own model). None: off."""

    placement: Literal["colocated", "separate"] = "colocated"
    """Where the engine samples: `colocated`, in the agent's trainer process (the learner's weights, or beside them);
    `separate`, in a Ray actor of its own with its own copy of the weights (`resources`), which takes each policy
    version the learner publishes through Ray's object store when a generate asks for it, so that with
    `train.max_staleness` > 0 it generates the next rollouts while its own learner updates. Needs Ray and the hf
    engine, on a full-model agent of one worker."""
    resources: ResourcesConfig | None = None
    """`placement: separate`: the engine actor's CPUs and GPUs; None: the same as the agent's `resources`."""
    max_staleness: int | None = Field(None, ge=0)
    """Most policy versions this agent's actions (and its partners' in the same episode) may be behind their
    learners when this agent's update uses them; staler ones are dropped and counted (`staleness/NAME/dropped`).
    None: `train.max_staleness`. At most `train.max_staleness`, which sets how far rollouts run ahead (see
    docs/roles-and-schedules.md, "Asynchronous rollouts")."""

    @model_validator(mode="after")
    def _engine_defaults(self) -> RolloutConfig:
        if self.engine == "vllm":
            if self.vllm is None:
                self.vllm = VLLMConfig()
            if "tis_cap" not in self.model_fields_set:
                self.tis_cap = 2.0
        return self


class AdapterConfig(_Strict):
    """A LoRA adapter (through `peft`): the agent trains only the adapter; its base model stays frozen and may be
    shared with other adapter agents on one host (see `hosts`)."""

    rank: int = Field(8, ge=1)
    """LoRA rank r: each adapted weight W gets W + (alpha / r) * B @ A with A (r x in), B (out x r)."""
    alpha: float = Field(16.0, gt=0.0)
    """LoRA scaling numerator: the update B @ A is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input during updates (sampling never drops); 0: none, so the update trains the
    policy that sampled."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (or name suffixes) that get an adapter, e.g. [q_proj, v_proj]; `all-linear`: every linear
    layer but the output head."""
    path: str | None = None
    """Start from this saved adapter (a directory with adapter_config.json: a checkpoint's `agents/NAME/adapter`,
    or any peft LoRA adapter of this base), relative to the config file; its own settings apply, so rank,
    alpha, dropout and target_modules are then left out. None: a fresh adapter (B = 0: the agent starts as the
    base)."""

    def overridden(self) -> list[str]:
        """Settings given besides `path` (with a value other than the default): a saved adapter has its own."""
        return sorted(k for k in self.model_fields_set - {"path"}
                      if getattr(self, k) != type(self).model_fields[k].default)


class HostConfig(_Strict):
    """One process that holds several agents: adapter agents on one shared copy of their base model."""

    resources: ResourcesConfig = ResourcesConfig()
    """Resources of the host's actor, shared by its agents (their calls run one at a time)."""


class AgentConfig(_Strict):
    model: str
    """`builtin:tiny`, `builtin:smollm2-135m-instruct`, a local path, or a hub id."""
    tokenizer: str | None = None
    """Tokenizer path or hub id; None: the model's."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype. `auto`, decided where the trainer runs, on its device: where the device computes bfloat16
    natively (a CUDA GPU of compute capability 8.0 or later; a CPU with AVX-512 BF16 or AMX), whichever of bfloat16
    and float32 a short measurement of the agent's own shapes finds faster (bfloat16 only when at least 5% faster;
    cached per machine and shape); float16 with loss scaling on an older GPU; float32 otherwise; `builtin:tiny`
    stays float32 (bf16 gains nothing at its size, and the demo's recorded figures are float32). The run prints
    which dtype each agent got, what was measured and why. An explicit
    bfloat16 on a device that only emulates it (often several times slower than float32) gets a warning at
    start with the slowdown measured there. A trainable agent keeps float32 master weights and optimizer state
    and computes in this dtype under autocast (float16 with loss scaling); a frozen agent stores its weights in
    it."""
    micro_batch_size: int = Field(16, ge=1)
    """Sequences per forward/backward in an update; gradients accumulate over micro-batches."""
    generation: GenerationConfig = GenerationConfig()
    """Sampling settings."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer and learning-rate schedule."""
    resources: ResourcesConfig = ResourcesConfig()
    """Resources of the trainer actor."""
    rollout: RolloutConfig = RolloutConfig()
    """The engine that samples completions, and how the update corrects for its log-prob gap."""
    adapter: AdapterConfig | None = None
    """Train a LoRA adapter on the frozen model instead of the whole model; None: full fine-tuning."""
    host: str | None = None
    """The host (a name in `hosts`) this agent lives in, with the other agents that name it: they share one
    process and one copy of the base model, each with its own adapter, optimizer and state. None: a host of
    its own (today's one-agent trainer), with `resources`."""


# ----------------------------------------------------------------------------------- environment
class EnvironmentConfig(_Strict):
    name: str
    """Import path `package.module:Class`, or `file.py:Class` relative to the config file."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for the environment's constructor."""


class RolesConfig(_Strict):
    assignment: dict[str, str] | None = None
    """Role -> agent (one agent may hold several roles); with a `cycle`, its first entry (may be omitted)."""
    rotation: Literal["none", "per_episode", "per_turn"] = "none"
    """How often the seating advances along the cycle: never, every episode, or every turn."""
    cycle: list[dict[str, str]] | None = None
    """Explicit cycle of seatings (needs a rotation); None: the rotations of `assignment` (role i gets role
    i+1's agent)."""
    attempts: dict[str, int] = {}
    """Role -> k: that role answers each of its prompts k times in one turn (its k attempts share the prompt, go in
    one batched generate and are one advantage group), over the environment's own `attempts`, which must list the
    role. {}: the environment's k."""

    @model_validator(mode="after")
    def _seatings(self) -> RolesConfig:
        if self.cycle is not None and not self.cycle:
            raise ValueError("roles.cycle: give at least one seating, or leave it out")
        if self.assignment is None and not self.cycle:
            raise ValueError("roles.assignment: missing; seat every role (role: agent), or give roles.cycle")
        if self.cycle and self.rotation == "none":
            raise ValueError("roles.cycle: a cycle needs roles.rotation per_episode or per_turn (with rotation none "
                             "only its first seating would ever be used)")
        if self.cycle and self.assignment is not None and self.assignment != self.cycle[0]:
            raise ValueError(f"roles.assignment: {self.assignment} differs from roles.cycle's first seating "
                             f"{self.cycle[0]}; drop roles.assignment or make them equal")
        seated = self.seatings()[0]
        for role, k in self.attempts.items():
            problem = attempts_value_problem(f"roles.attempts.{role}", role, k, seated)
            if problem:
                raise ValueError(problem)
        return self

    def seatings(self) -> list[dict[str, str]]:
        """Every seating the run may use: the cycle, or the assignment's rotations (just it without rotation)."""
        if self.cycle:
            return [dict(a) for a in self.cycle]
        roles = list(self.assignment)
        if self.rotation == "none":
            return [dict(self.assignment)]
        agents = [self.assignment[r] for r in roles]
        return [{roles[i]: agents[(i + k) % len(roles)] for i in range(len(roles))} for k in range(len(roles))]


def attempts_value_problem(key: str, role: str, k: int, seated: dict[str, str]) -> str | None:
    """Why `key: k` cannot give `role` k attempts per prompt (k < 1, a role no seating seats), or None."""
    if k < 1:
        return f"{key}: {k}; a role answers each prompt k >= 1 times; give k >= 1, or remove it for the environment's k"
    if role not in seated:
        return (f"{key}: {k}, but no seating seats role {role!r} (seated: {', '.join(seated)}); fix the role's name "
                "or remove it")
    return None


class ScheduleConfig(_Strict):
    kind: Literal["simultaneous", "alternate", "round_robin", "pattern"] = "simultaneous"
    """Which agents update at each step: all trainable ones; two agents taking turns (`alternate`); any
    number taking turns (`round_robin`); an explicit cycle of agent sets (`pattern`)."""
    period: int = Field(1, ge=1)
    """`alternate` / `round_robin`: steps each agent trains before the next one's turn."""
    order: list[str] | None = None
    """`alternate` (two agents) / `round_robin`: agents in turn order; None: the trainable agents as declared."""
    pattern: list[list[str]] | None = None
    """`pattern`: agent sets cycled one per step."""
    frozen: list[str] = []
    """Agents that never update (opponents, judges)."""


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


# ------------------------------------------------------------------------------------- data/run
class DataConfig(_Strict):
    path: str | None = None
    """A json/jsonl/csv/parquet file, or a directory written by `datasets`' `save_to_disk` (a `Dataset`, or a
    `DatasetDict` whose `split` is used), relative to the config file."""
    factory: str | None = None
    """`module:function` or `file.py:function` returning a `datasets.Dataset`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for `factory`."""
    hub: str | None = None
    """A dataset name for `datasets.load_dataset` (needs the hub, or its local cache)."""
    split: str = "train"
    """Split to use with `hub`, or of a saved `DatasetDict` under `path`."""
    shuffle: bool = True
    """Reshuffle the data each epoch with the run's seed."""

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        given = [k for k in ("path", "factory", "hub") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"data: set exactly one of path, factory, hub (got {given or 'none'})")
        if self.path is not None and self.kwargs:
            raise ValueError(f"data.kwargs: {sorted(self.kwargs)} would be ignored: kwargs go to data.factory or "
                             "data.hub, not data.path; remove them")
        return self


class EvalConfig(_Strict):
    data: DataConfig
    """Held-out samples (path, factory or hub, with split); none may also be a training sample."""
    every: int = Field(0, ge=0)
    """Evaluate every this many steps; always before the first step and after the last. 0: only those two."""
    episodes_per_sample: int = Field(1, ge=1)
    """Episodes played from each held-out sample (pass@k needs k of them)."""
    max_samples: int | None = Field(None, ge=1)
    """Evaluate on the first this many held-out samples; None: all."""
    temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature of evaluation episodes; 0 decodes greedily."""
    environment_kwargs: dict[str, Any] = {}
    """Environment kwargs for evaluation, over `environment.kwargs` (e.g. {opponent: random})."""
    pass_k: list[int] = []
    """k values of pass@k (unbiased estimator) over each sample's episodes, where episodes report `success`, and
    over each prompt's attempts, where an attempts role's attempts report `success` (`eval/pass@k/ROLE`); each k
    at most episodes_per_sample or some role's attempts."""
    attempts: dict[str, int] = {}
    """Role -> k for evaluation episodes, over roles.attempts and the environment's own; {}: as in training."""
    partners: dict[str, dict[str, str]] = {}
    """Extra evaluations, label -> {agent: `initial` | `scripted` | a checkpoint or model directory}: that agent
    plays at its initial weights, as the environment's scripted player, or with those weights; the others as trained."""
    partner_resources: ResourcesConfig = ResourcesConfig(num_cpus=0.1)
    """Resources of each partner's trainer (a frozen copy of its agent's model that only generates); on GPUs
    give it a share, e.g. {num_gpus: 0.2}."""
    seed: int | None = None
    """Seed of evaluation episodes (the same at every evaluation, so curves compare like with like); None: train.seed."""
    transcripts: int = Field(8, ge=0)
    """Episodes of each evaluation (per setting: as trained and each partner label) written whole to
    RUN_DIR/eval_transcripts.jsonl, the first ones played; bounded in size by train.transcripts_max_mb. 0: none."""

    @model_validator(mode="after")
    def _checks(self) -> EvalConfig:
        for k in self.pass_k:
            if k < 1:
                raise ValueError(f"eval.pass_k: k={k} needs 1 <= k <= eval.episodes_per_sample "
                                 f"({self.episodes_per_sample}); raise episodes_per_sample or drop k")
        for label in self.partners:
            if not label or not all(c.isalnum() or c in "_-" for c in label):
                raise ValueError(f"eval.partners: label {label!r} must be letters, digits, '_' or '-' (it names metrics)")
        return self


STORAGE_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
"""URI schemes train.storage takes: those pyarrow.fs opens."""


def storage_problem(value: str) -> str | None:
    """Why `value` is not a usable train.storage, or None."""
    if not value.strip():
        return "train.storage: empty; leave it out (checkpoints in the run directory) or give a URI"
    scheme, sep, rest = value.partition("://")
    if not sep:
        return None  # a path (on a shared filesystem), resolved against the config file
    problem = credentials_problem(value, "train.storage")
    if problem:
        return problem
    if scheme not in STORAGE_SCHEMES:
        return (f"train.storage: scheme {scheme!r} of {value!r} is not supported; give one of "
                f"{', '.join(s + '://' for s in STORAGE_SCHEMES)}, or a path on a shared filesystem")
    if scheme == "file" and not rest.startswith("/"):
        return f"train.storage: {value!r} is not an absolute file URI; write file:///absolute/path"
    if scheme != "file" and not rest.strip("/"):
        return f"train.storage: {value!r} names no bucket or host; write {scheme}://bucket/prefix"
    return None


_SECRET_WORDS = ("key", "secret", "token", "password", "sas", "credential")
"""A URI's query option whose name holds one of these carries a credential (pyarrow's access_key, secret_key,
session_token for S3; account_key, sas_token, client_secret for Azure)."""


def credentials_problem(uri: str, what: str) -> str | None:
    """Why the storage URI `uri` (given as `what`) must be refused: it carries credentials (a password before the
    host, S3's `KEY:SECRET@`, a secret query option), which would be written to config.yaml, store.json, the store
    and reports; None when it carries none. The message shows the URI with them hidden."""
    import re
    from urllib.parse import parse_qsl, urlsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return None
    userinfo = parts.netloc.rpartition("@")[0] if "@" in parts.netloc else ""
    secret_options = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True)
                      if any(word in k.lower() for word in _SECRET_WORDS)]
    if not (":" in userinfo or (userinfo and parts.scheme == "s3") or secret_options):
        return None
    shown = uri.replace(f"{userinfo}@", "***@") if userinfo else uri
    for option in secret_options:
        shown = re.sub(rf"([?&]{re.escape(option)}=)[^&#]*", r"\1***", shown)
    return (f"{what}: {shown!r} holds credentials, which would be written to config.yaml, store.json, the store and "
            "reports; remove them and give them as the store's client takes them: environment variables such as "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (ray.forward_env passes them to every trainer), config files "
            "or instance roles")


class TrainConfig(_Strict):
    steps: int = Field(10, ge=1)
    """Training steps."""
    batch_size: int = Field(4, ge=1)
    """Samples per step; each plays `num_generations` episodes."""
    num_generations: int = Field(4, ge=1)
    """Episodes per sample: the group over which advantages are relative."""
    seed: int = 0
    """Seed of data order, sampling and every RNG."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest checkpoints kept."""
    run_dir: str = "runs/{name}-{time}"
    """Run directory; `{name}` is the config file's stem, `{time}` the start time."""
    storage: str | None = None
    """Where checkpoints go. None: `RUN_DIR/checkpoints`, which every node hosting a trainer must then see (one
    machine, or a shared filesystem; checked at start). Else a URI every node reaches: `s3://bucket/prefix`,
    `gs://...`, `hdfs://...`, `file:///shared/path`, or a path on a shared filesystem (relative to the config
    file); checkpoints go to `STORAGE/RUN_NAME/checkpoints/`, and each trainer uploads and downloads its own
    files there through pyarrow.fs (object stores take their credentials as pyarrow does: environment, config
    files, instance roles). Each checkpoint there also carries the run directory's records (config, source,
    metrics, transcripts), so `marsi resume STORAGE/RUN_NAME` continues the run from the store alone."""
    storage_timeout_s: float | None = Field(120.0, gt=0.0)
    """Seconds any one call to checkpoint storage may take (a listing, opening a file, one 8 MiB chunk read or
    written, a move), on the coordinator and on every trainer; a call that takes longer stops with one line
    naming what was being done and where (an unreachable bucket, a hung NFS mount). None waits forever."""
    max_restarts: int = Field(3, ge=0)
    """Times a dead or hung trainer is restarted (all trainers restored from the last checkpoint) before the run stops."""
    call_timeout_s: float | None = Field(3600.0, gt=0.0)
    """A generate or update taking longer than this counts as a hung trainer (Ray trainers); None waits forever."""
    checkpoint_timeout_s: float | None = Field(3600.0, gt=0.0)
    """A trainer's save or load (or its storage probe at start) taking longer than this counts as a hung trainer (Ray
    trainers); None waits forever."""
    start_timeout_s: float | None = Field(1800.0, gt=0.0)
    """Trainers not up (model loaded) this long after placement fail the start (Ray trainers); None waits forever."""
    transcripts_per_step: int = Field(2, ge=0)
    """Episodes per step written whole to transcripts.jsonl, spread over the step's samples (the first episode of
    each sample's group, then the second of each, ...), each turn with its prompt, completion, reward, advantage
    and the acting agent's policy version; `marsi report` browses them. 0: none."""
    transcripts_max_mb: float | None = Field(200.0, gt=0.0)
    """Size bound of transcripts.jsonl and of eval_transcripts.jsonl, each, in MB. A step whose transcripts would
    take a file past it writes none, and neither does any later step (metrics go on; a line on stderr says so once);
    resuming with a higher bound writes them again from there. None: no bound."""
    progress: bool = True
    """Show a progress bar."""
    max_staleness: int = Field(0, ge=0)
    """K: how many policy versions an action may be behind its learner (and its partners' learners) when an update
    uses it. 0: synchronous, every step generates then updates. K > 0: the rollouts of the next steps are played
    while the current step's updates run, as far ahead as the schedule keeps every agent within K versions (under
    `simultaneous` K steps ahead, under `alternate` 2K); each action records the version that drew it, and the
    update's importance weights are taken against its behaviour log-probs (see docs/roles-and-schedules.md,
    "Asynchronous rollouts"). Overridable per agent with `agents.NAME.rollout.max_staleness`."""

    @model_validator(mode="after")
    def _storage(self) -> TrainConfig:
        problem = storage_problem(self.storage) if self.storage is not None else None
        if problem:
            raise ValueError(problem)
        return self


class LoggingConfig(_Strict):
    tensorboard: bool = False
    """Also write TensorBoard events to RUN_DIR/tensorboard (needs the `tensorboard` extra): every scalar of every
    metrics.jsonl row, evaluation rows included, at its step; a resume drops the replayed steps' events."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (needs the `wandb` extra), the run named after its directory:
    every scalar of every metrics.jsonl row with `step` as the x-axis, and the saved episodes as tables
    `episodes` and `eval/episodes` (one row per action: step, episode, turn, agent, role, prompt, completion,
    reward, episode_reward, advantage, policy_version). `marsi resume` continues the same W&B run.
    `WANDB_MODE=offline` keeps it under RUN_DIR/wandb/ (`wandb sync` uploads it later)."""


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
    """The learned value function of `algorithm.baseline: critic` (its defaults when that baseline is chosen
    without this section); None otherwise."""

    @model_validator(mode="after")
    def _vllm_cache_sized_to_the_run(self) -> RunConfig:
        """Each vLLM agent's CPU KV cache holds the rows of its largest generate call (`kv_cache_sequences`)."""
        for name, agent in self.agents.items():
            settings = agent.rollout.vllm
            if agent.rollout.engine != "vllm" or settings.kv_cache_gb is not None or settings.kv_cache_sequences:
                continue
            seats = max([sum(self.roles.attempts.get(r, 1) for r, a in seating.items() if a == name)
                         for seating in self.roles.seatings()] or [1])
            rows = self.train.batch_size * self.train.num_generations * max(1, seats)
            vllm = settings.model_copy(update={"kv_cache_sequences": min(rows, settings.max_num_seqs)})
            self.agents[name] = agent.model_copy(update={"rollout": agent.rollout.model_copy(update={"vllm": vllm})})
        return self

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        agents = list(self.agents)
        if not agents:
            raise ValueError("agents: define at least one agent")

        def known(key: str, names: list[str]) -> None:
            for name in names:
                if name not in self.agents:
                    raise ValueError(f"{key}: agent {name!r} is not defined; defined agents: {', '.join(agents)}")

        for name, agent in self.agents.items():
            workers = agent.resources.num_workers
            if workers > 1 and not self.ray.enabled:
                raise ValueError(f"agents.{name}.resources.num_workers: {workers} workers are {workers} processes, "
                                 f"which need Ray, but ray.enabled is false (one process); set ray.enabled: true or "
                                 f"agents.{name}.resources.num_workers: 1")
            if workers > 1 and 0 < agent.resources.num_gpus < 1:
                raise ValueError(f"agents.{name}.resources.num_gpus: {agent.resources.num_gpus:g} per worker would let two "
                                 f"of the {workers} workers of agent {name!r} share a GPU, which NCCL refuses; give each worker "
                                 f"a whole GPU (agents.{name}.resources.num_gpus: 1) or set "
                                 f"agents.{name}.resources.num_workers: 1")
            if workers > 1 and agent.rollout.engine == "vllm":
                raise ValueError(f"agents.{name}.resources.num_workers: {workers} workers cannot sample with "
                                 f"agents.{name}.rollout.engine: vllm (a colocated vLLM engine takes its process's "
                                 f"torch.distributed group); set agents.{name}.rollout.engine: hf or "
                                 f"agents.{name}.resources.num_workers: 1")
            rollout = agent.rollout
            if rollout.engine == "hf" and rollout.vllm is not None:
                raise ValueError(f"agents.{name}.rollout.vllm: vLLM settings are given but agents.{name}.rollout.engine "
                                 f"is 'hf'; set agents.{name}.rollout.engine: vllm or remove agents.{name}.rollout.vllm")
            if rollout.vllm is not None and rollout.vllm.sleep_mode and agent.resources.num_gpus == 0:
                raise ValueError(f"agents.{name}.rollout.vllm.sleep_mode: true frees GPU memory during updates, but "
                                 f"agents.{name}.resources.num_gpus is 0 (vLLM has no sleep mode on CPU); set "
                                 f"agents.{name}.rollout.vllm.sleep_mode: false or give the agent a GPU")
        for name, agent in self.agents.items():
            own = agent.rollout.max_staleness
            if "tis_cap" not in agent.rollout.model_fields_set and (own if own is not None else self.train.max_staleness):
                agent.rollout.tis_cap = 2.0  # stale actions: weighted against the policy that drew them
            if rollout_problem := separate_engine_problem(name, agent, self.ray.enabled):
                raise ValueError(rollout_problem)
            if own is not None and own > self.train.max_staleness:
                raise ValueError(f"agents.{name}.rollout.max_staleness: {own} is above train.max_staleness "
                                 f"{self.train.max_staleness}, which sets how far rollouts run ahead, so no action is "
                                 f"ever that stale and it would change nothing; lower it, or raise train.max_staleness")
        problem = hosts_problem(self)
        if problem:
            raise ValueError(problem)
        own = [f"{section}.{name}" for section, specs in (("agents", self.agents), ("hosts", self.hosts))
               for name, spec in specs.items() if spec.resources.placement_strategy is not None]
        if own and self.ray.placement_strategy.startswith("STRICT_"):
            raise ValueError(f"ray.placement_strategy: {self.ray.placement_strategy} holds all trainers as one group, but "
                             f"{own[0]}.resources.placement_strategy places that agent's workers as a group of their own; "
                             f"set ray.placement_strategy to PACK or SPREAD, or remove {own[0]}.resources.placement_strategy")
        for name, agent in self.agents.items():
            if agent.host is not None:  # a hosted agent runs on its host's resources
                agent.resources = self.hosts[agent.host].resources
        seatings = self.roles.seatings()
        for i, seating in enumerate(seatings):
            known(f"roles.cycle.{i}" if self.roles.cycle else "roles.assignment", list(seating.values()))
            if set(seating) != set(seatings[0]):
                raise ValueError(
                    f"roles.cycle.{i}: roles {sorted(seating)} differ from the first seating's {sorted(seatings[0])}; "
                    "every seating must seat the same roles"
                )
        seated = {agent for seating in seatings for agent in seating.values()}
        for name in agents:
            if name not in seated:
                raise ValueError(f"agents.{name}: holds no role in roles.assignment or roles.cycle, so it would load "
                                 "and never act; seat it or remove it")
        known("schedule.frozen", self.schedule.frozen)
        known("schedule.order", self.schedule.order or [])
        for i, group in enumerate(self.schedule.pattern or []):
            known(f"schedule.pattern.{i}", group)
        if self.schedule.kind == "pattern" and not self.schedule.pattern:
            raise ValueError("schedule.pattern: kind 'pattern' needs a non-empty list of agent lists")
        frozen_ordered = set(self.schedule.order or []) & set(self.schedule.frozen)
        if frozen_ordered:
            raise ValueError(f"schedule.order: {sorted(frozen_ordered)} are also in schedule.frozen; remove them from one")
        for i, group in enumerate(self.schedule.pattern or []):
            frozen_listed = sorted(set(group) & set(self.schedule.frozen))
            if frozen_listed:
                raise ValueError(f"schedule.pattern.{i}: {frozen_listed} are also in schedule.frozen; remove them from one")
        if self.schedule.kind == "alternate":
            takers = self.schedule.order or [a for a in agents if a not in self.schedule.frozen]
            if len(takers) != 2:
                raise ValueError(f"schedule.kind: alternate takes turns between two agents, got {len(takers)} "
                                 f"({', '.join(takers) or 'none'}); use round_robin for any number, or set schedule.order")
        known("algorithm.agents", list(self.algorithm.agents))
        if self.algorithm.agents and self.algorithm.baseline == "critic":
            raise ValueError(f"algorithm.agents: {', '.join(self.algorithm.agents)} set their own baseline or groups, "
                             "but with algorithm.baseline: critic every agent's credit comes from the critic; remove "
                             "algorithm.agents or set algorithm.baseline: group or ema")
        grouped = any(self.algorithm.for_agent(a).baseline in GROUPED for a in agents)
        if grouped and self.train.num_generations < 2:
            raise ValueError(
                f"train.num_generations: group-relative advantages need at least 2 episodes per group "
                f"(got {self.train.num_generations}); set train.num_generations >= 2 or algorithm.baseline=ema"
            )
        problem = critic_problem(self)
        if problem:
            raise ValueError(problem)
        for label, held in (self.eval.partners if self.eval else {}).items():
            known(f"eval.partners.{label}", list(held))
        for role, k in (self.eval.attempts if self.eval else {}).items():
            problem = attempts_value_problem(f"eval.attempts.{role}", role, k, seatings[0])
            if problem:
                raise ValueError(problem)
        if self.eval and self.eval.partners and self.eval.partner_resources.num_workers > 1:
            raise ValueError(f"eval.partner_resources.num_workers: {self.eval.partner_resources.num_workers}; a partner "
                             "only generates for evaluations, on one worker; set eval.partner_resources.num_workers: 1")
        distinct = len({tuple(sorted(seating.items())) for seating in seatings})
        if (self.algorithm.baseline in GROUPED and self.roles.rotation == "per_episode" and distinct > 1
                and "role" in self.algorithm.group_by and self.train.num_generations // distinct < 2):
            raise ValueError(
                f"train.num_generations: with roles.rotation per_episode over {distinct} seatings, each (agent, role) "
                f"group of a sample gets num_generations / {distinct} episodes, fewer than 2 with "
                f"num_generations={self.train.num_generations}; set train.num_generations to a multiple of "
                f"{distinct} that is at least {2 * distinct}"
            )
        return self


def separate_engine_problem(name: str, agent: AgentConfig, ray_enabled: bool) -> str | None:
    """Why agent `name`'s `rollout.placement: separate` cannot be, naming the key and the fix, or None."""
    rollout = agent.rollout
    if rollout.placement != "separate":
        if rollout.resources is not None:
            return (f"agents.{name}.rollout.resources: engine resources are given but agents.{name}.rollout.placement "
                    f"is 'colocated' (the engine shares the trainer's); set agents.{name}.rollout.placement: separate "
                    f"or remove agents.{name}.rollout.resources")
        return None
    key = f"agents.{name}.rollout.placement: separate"
    if not ray_enabled:
        return f"{key} runs the engine in a process of its own, which needs Ray, but ray.enabled is false; set ray.enabled: true or placement: colocated"
    if rollout.engine != "hf":
        return f"{key} is built for the hf engine (got {rollout.engine!r}); set agents.{name}.rollout.engine: hf or placement: colocated"
    if agent.adapter is not None or agent.host is not None or agent.resources.num_workers > 1:
        return (f"{key} is built for a full-model agent of one worker on a host of its own; remove agents.{name}.adapter, "
                f"agents.{name}.host and agents.{name}.resources.num_workers, or set placement: colocated")
    return None


def host_layout(config: RunConfig) -> dict[str, list[str]]:
    """Host name -> the agents it holds, in declaration order: the hosts of `hosts` that agents name, then one
    host per agent without `host`, named after the agent."""
    layout: dict[str, list[str]] = {}
    for name, agent in config.agents.items():
        layout.setdefault(agent.host or name, []).append(name)
    return layout


CENTRAL_CRITIC = "critic"
"""The name of the central critic (`critic.kind: central`); a per-agent critic is `critic-AGENT`."""


def critic_members(config: RunConfig) -> dict[str, list[str]]:
    """Critic name -> the agents whose actions it values: one per trainable agent (`per_agent`), or one for
    every agent (`central`); empty without a critic."""
    critic = config.critic
    if critic is None:
        return {}
    trainable = [a for a in config.agents if a not in config.schedule.frozen]
    if critic.kind == "central":
        return {CENTRAL_CRITIC: list(config.agents)}
    return {f"{CENTRAL_CRITIC}-{a}": [a] for a in trainable}


def critic_host_agent(config: RunConfig, critic: str) -> str | None:
    """The agent whose host holds `critic` (`placement: agent`), or None (a host of its own, named after it)."""
    if config.critic.placement == "own":
        return None
    if config.critic.kind == "central":
        return config.critic.agent or next(iter(config.agents))
    return critic_members(config)[critic][0]


def member_layout(config: RunConfig) -> dict[str, list[str]]:
    """Host name -> the agents and then the critics it holds: `host_layout`, with each critic in its agent's
    host (`critic.placement: agent`) or in one of its own, named after it."""
    layout = host_layout(config)
    for name in critic_members(config):
        agent = critic_host_agent(config, name)
        layout.setdefault(config.agents[agent].host or agent if agent else name, []).append(name)
    return layout


def host_resources(config: RunConfig) -> dict[str, ResourcesConfig]:
    """Host name -> what it asks of the cluster: its first agent's resources, or a critic's own."""
    return {host: config.agents[names[0]].resources if names[0] in config.agents else config.critic.resources
            for host, names in member_layout(config).items()}


def critic_problem(config: RunConfig) -> str | None:
    """Why the `critic` section does not fit the run, naming the keys and the fix, or None. Fills in the
    section's defaults when `algorithm.baseline: critic` comes without it."""
    baseline = config.algorithm.baseline
    if baseline == "critic" and config.critic is None:
        config.critic = CriticConfig()
    critic = config.critic
    if critic is None:
        return None
    if baseline != "critic":
        return (f"critic: given, but algorithm.baseline is {baseline!r}, which uses no critic; set "
                "algorithm.baseline: critic or remove the critic section")
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


_SHARED = ("model", "tokenizer", "dtype")
"""What the agents of one host must agree on: they share one base model and its tokenizer."""


def hosts_problem(config: RunConfig) -> str | None:
    """Why the agents' hosts do not hold together, naming the keys and the fix, or None."""
    for name, agent in config.agents.items():
        if agent.adapter is not None and agent.rollout.engine == "vllm":
            return (f"agents.{name}.adapter: adapter agents sample with the hf engine (the vllm engine serves full "
                    f"models only); set agents.{name}.rollout.engine: hf or remove agents.{name}.adapter")
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


# ---------------------------------------------------------------------------------------- loading
def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `dotted.key=value` overrides (values parsed as YAML) onto a nested dict, in place."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. train.steps=5")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} holds a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw


def _describe(error: dict[str, Any], model: type[BaseModel]) -> str:
    loc = [str(p) for p in error["loc"]]
    key = ".".join(loc)
    if error["type"] == "extra_forbidden":
        parent = _model_at(model, error["loc"][:-1])
        allowed = ", ".join(parent.model_fields) if parent else "see `marsi schema`"
        return f"{key}: unknown key; allowed keys here: {allowed}"
    msg = error["msg"].removeprefix("Value error, ")
    if not loc or msg.startswith((f"{key}: ", f"{key}.")):  # a cross-field check that names its own keys
        return msg
    if error["type"] == "missing":
        return f"{key}: missing; this key is required (see `marsi schema`)"
    return f"{key}: {msg} (got {error.get('input')!r})"


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that sits at `loc` inside `model`, if any."""
    current: Any = model
    dict_key = False
    for part in loc:
        if isinstance(part, int) or current is None or dict_key:
            dict_key = False
            continue
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
            current = field.annotation if field else None
        else:
            current = None
        dict_key = get_origin(current) is dict
        if current is not None and hasattr(current, "__args__"):  # dict[str, Model], list[...], Optional
            current = next((a for a in current.__args__ if isinstance(a, type) and issubclass(a, BaseModel)), current)
        if hasattr(current, "__args__"):
            current = None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


_MAX_VALUES = 100_000  # a config this large after alias expansion is an attack (a "billion laughs"), not a run


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the later one would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is not None and key != "<<" and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (each key may appear once; the later one would win)",
                    key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _expanded_size(value: Any, budget: int) -> int:
    """Values in `value` with every shared (aliased) node counted each time it appears; stops past `budget`."""
    count, stack = 0, [value]
    while stack and count <= budget:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count


def load_config(path: str | Path, overrides: list[str] | None = None, *, check_imports: bool = True) -> RunConfig:
    """Read, override and validate a run config; any problem raises a one-line `ConfigError`."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config ({exc.strerror}); check the path") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); "
                          "save the file as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_StrictLoader) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}{where}: malformed YAML: {problem}; fix the syntax there") from None
    if _expanded_size(raw, _MAX_VALUES) > _MAX_VALUES:
        raise ConfigError(f"{path}: expands to more than {_MAX_VALUES:,} values through YAML aliases (*name); "
                          "write the values out, or use fewer nested aliases")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (agents, environment, ...), got {type(raw).__name__}")
    try:
        apply_overrides(raw, overrides or [])
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return validate_config(raw, source=path, check_imports=check_imports)


def _model_source(key: str, value: str, base: Path, source: str | Path, check: bool) -> str:
    resolved, problem = model_source(key, value, base, check=check)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    return resolved


def validate_config(raw: dict[str, Any], *, source: str | Path = "<config>", check_imports: bool = True) -> RunConfig:
    """Validate a config mapping; `source` names it in errors and anchors relative paths."""
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"{source}: {_describe(errors[0], RunConfig)}{more}") from None
    # Paths relative to the config file become absolute (and ~ is expanded), so the resolved config stands alone.
    base = Path(source).resolve().parent if str(source) != "<config>" else Path.cwd()
    config.environment.name = absolute_spec(config.environment.name, base)
    for key, data in (("data", config.data), ("eval.data", config.eval.data if config.eval else None)):
        if data is None:
            continue
        if data.factory is not None:
            data.factory = absolute_spec(data.factory, base)
        if data.path is not None:
            data.path = str((base / Path(data.path).expanduser()).resolve())
        if check_imports and data.path is not None and not Path(data.path).exists():
            raise ConfigError(f"{source}: {key}.path: file {data.path!r} not found; fix the path")
        if check_imports and data.factory is not None:
            try:
                import_object(data.factory)
            except ImportPathError as exc:
                raise ConfigError(f"{source}: {key}.factory: {exc}") from None
    for label, held in (config.eval.partners if config.eval else {}).items():
        for agent, source_weights in held.items():
            if source_weights not in ("initial", "scripted"):
                local = (base / Path(source_weights).expanduser()).resolve()
                if check_imports and not local.is_dir():
                    raise ConfigError(f"{source}: eval.partners.{label}.{agent}: {str(local)!r} is not a directory; give "
                                      "initial, scripted, or a checkpoint or model directory")
                held[agent] = str(local)
    if config.train.storage is not None and "://" not in config.train.storage:
        config.train.storage = str((base / Path(config.train.storage).expanduser()).resolve())
    on_cluster = joins_cluster(config.ray)
    problem = forward_env_problem(config.ray.forward_env) if check_imports else None
    if problem:
        raise ConfigError(f"{source}: {problem}")
    check_models = check_imports and not on_cluster  # on a cluster: checked on the node that hosts each agent
    for name, agent in config.agents.items():
        for key in ("model", "tokenizer"):
            value = getattr(agent, key)
            if value is not None:
                setattr(agent, key, _model_source(f"agents.{name}.{key}", value, base, source, check_models))
        adapter = agent.adapter
        if adapter is not None and adapter.path is not None:
            local = (base / Path(adapter.path).expanduser()).resolve()
            if check_imports and not (local / "adapter_config.json").is_file() and not on_cluster:
                raise ConfigError(f"{source}: agents.{name}.adapter.path: {str(local)!r} holds no adapter_config.json; "
                                  "give a saved adapter's directory (a checkpoint's agents/NAME/adapter)")
            adapter.path = str(local)
            if config.algorithm.beta > 0 and name not in config.schedule.frozen:
                raise ConfigError(f"{source}: agents.{name}.adapter.path: a trainable adapter agent's KL reference is its "
                                  f"base with adapters off, not the saved adapter it starts from, so algorithm.beta "
                                  f"{config.algorithm.beta:g} would pull it back to the base; set algorithm.beta: 0, or "
                                  "freeze it (schedule.frozen), or start from a fresh adapter")
    if config.critic is not None and config.critic.model != "agent":
        config.critic.model = _model_source("critic.model", config.critic.model, base, source, check_models)
    if check_imports:
        try:
            import_object(config.environment.name)
        except ImportPathError as exc:
            raise ConfigError(f"{source}: environment.name: {exc}") from None
    return config

