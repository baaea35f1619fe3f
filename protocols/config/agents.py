"""`agents.NAME`: each agent's model, sampling, optimizer, resources, rollout engine, adapter and host; and
`hosts.NAME`, a process several adapter agents share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from protocols.config.base import _Strict
from protocols.config.cluster import ResourcesConfig
from protocols.config.rollout import RolloutConfig, rollout_problem

if TYPE_CHECKING:
    from protocols.config.run import RunConfig


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


def agents_problem(config: RunConfig) -> str | None:
    """Why the agents do not fit the run (none defined, workers without Ray, GPUs NCCL cannot split, settings of an
    engine they do not use, a rollout that cannot be), naming the keys and the fix, or None."""
    if not config.agents:
        return "agents: define at least one agent"
    for name, agent in config.agents.items():
        problem = workers_problem(name, agent, config.ray.enabled) or engine_settings_problem(name, agent)
        if problem:
            return problem
    for name, agent in config.agents.items():
        problem = rollout_problem(name, agent, config)
        if problem:
            return problem
    return None


def workers_problem(name: str, agent: AgentConfig, ray_enabled: bool) -> str | None:
    """Why agent `name`'s data-parallel workers cannot run as set, or None."""
    workers = agent.resources.num_workers
    if workers > 1 and not ray_enabled:
        return (f"agents.{name}.resources.num_workers: {workers} workers are {workers} processes, "
                f"which need Ray, but ray.enabled is false (one process); set ray.enabled: true or "
                f"agents.{name}.resources.num_workers: 1")
    if workers > 1 and 0 < agent.resources.num_gpus < 1:
        return (f"agents.{name}.resources.num_gpus: {agent.resources.num_gpus:g} per worker would let two "
                f"of the {workers} workers of agent {name!r} share a GPU, which NCCL refuses; give each worker "
                f"a whole GPU (agents.{name}.resources.num_gpus: 1) or set "
                f"agents.{name}.resources.num_workers: 1")
    if workers > 1 and agent.rollout.engine == "vllm" and agent.rollout.placement == "colocated":
        return (f"agents.{name}.resources.num_workers: {workers} workers cannot sample with "
                f"agents.{name}.rollout.engine: vllm (a colocated vLLM engine takes its process's "
                f"torch.distributed group); set agents.{name}.rollout.engine: hf, agents.{name}.rollout.placement: "
                f"separate or agents.{name}.resources.num_workers: 1")
    return None


def engine_settings_problem(name: str, agent: AgentConfig) -> str | None:
    """Why agent `name`'s vLLM settings do not fit its engine or its resources, or None (an adapter agent's sleep
    mode: `hosts.adapter_problem`)."""
    rollout = agent.rollout
    if rollout.engine == "hf" and rollout.vllm is not None:
        return (f"agents.{name}.rollout.vllm: vLLM settings are given but agents.{name}.rollout.engine "
                f"is 'hf'; set agents.{name}.rollout.engine: vllm or remove agents.{name}.rollout.vllm")
    if rollout.vllm is not None and rollout.vllm.sleep_mode and agent.adapter is None and agent.resources.num_gpus == 0:
        return (f"agents.{name}.rollout.vllm.sleep_mode: true frees GPU memory during updates, but "
                f"agents.{name}.resources.num_gpus is 0 (vLLM has no sleep mode on CPU); set "
                f"agents.{name}.rollout.vllm.sleep_mode: false or give the agent a GPU")
    return None
