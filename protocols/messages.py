"""Typed messages that cross the boundary between the coordinator and a trainer process."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from protocols.errors import UserError

ChatMessage = dict[str, str]
Prompt = str | list[ChatMessage]
"""A plain text prompt, or chat messages ({"role": ..., "content": ...}) for the chat template."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        from protocols.config import with_field_docs

        super().__pydantic_init_subclass__(**kwargs)
        cls.__doc__ = with_field_docs(cls)


class GenerateRequest(_Message):
    prompts: list[Prompt]
    """One prompt per completion wanted; repeat a prompt for several samples of it."""
    seed: int
    """Seeds the sampling, so a request replays exactly."""
    max_completion_length: int | None = Field(None, ge=1)
    """Overrides the agent's setting for this request."""
    temperature: float | None = Field(None, ge=0.0)
    """Overrides the agent's setting for this request; 0 decodes greedily (evaluation)."""
    policy_version: int | None = Field(None, ge=0)
    """The policy version the caller planned this request for (asynchronous rollouts); the agent refuses a request
    its weights are not at. None: whatever the weights are."""


class Completion(_Message):
    text: str
    """Decoded completion, up to and without the end-of-sequence token."""
    prompt_ids: list[int]
    """Prompt tokens the model saw (after chat template and truncation)."""
    completion_ids: list[int]
    """Sampled tokens, the end-of-sequence token included when sampled; no padding."""
    per_token_logps: list[float]
    """Log-probability of each completion token under the distribution it was sampled from (behaviour log-probs)."""
    finish_reason: Literal["stop", "length"]
    """`stop`: ended with end-of-sequence; `length`: hit max_completion_length."""
    prompt_truncated: bool = False
    """The prompt was longer than max_prompt_length and lost its start."""
    temperature: float | None = None
    """Sampling temperature the completion was drawn at; None: the agent's generation.temperature."""
    policy_version: int | None = None
    """Updates the sampling agent's weights had had when this was drawn (0: its initial weights); None: not drawn
    by a trainer (the environment's scripted player)."""


class GenerateResult(_Message):
    agent: str
    completions: list[Completion]
    seconds: float

    @classmethod
    def concat(cls, shares: list[GenerateResult]) -> GenerateResult:
        """One result of workers' shares of the rows, in worker order; the slowest worker's seconds."""
        return shares[0].model_copy(update={"completions": [c for r in shares for c in r.completions],
                                            "seconds": max(r.seconds for r in shares)})


class Experience(_Message):
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    """Scalar advantage given to every token of this completion."""
    old_per_token_logps: list[float] | None = None
    """Behaviour log-probs (at sampling time); the importance ratio's denominator when num_iterations > 1."""
    temperature: float | None = Field(None, gt=0.0)
    """Temperature the completion was sampled at; the update divides the logits by it. None: the agent's."""

    @classmethod
    def from_completion(cls, completion: Completion, advantage: float) -> Experience:
        return cls(prompt_ids=completion.prompt_ids, completion_ids=completion.completion_ids,
                   advantage=advantage, old_per_token_logps=completion.per_token_logps,
                   temperature=completion.temperature)

    def problem(self) -> str | None:
        """Why this experience must not be trained on (a non-finite number, a length mismatch), or None."""
        if not math.isfinite(self.advantage) or abs(self.advantage) > _FLOAT32_MAX:
            return f"advantage is {self.advantage}"
        logps = self.old_per_token_logps
        if logps is not None:
            if len(logps) != len(self.completion_ids):
                return f"old_per_token_logps has {len(logps)} values for {len(self.completion_ids)} completion tokens"
            for i, value in enumerate(logps):
                if not math.isfinite(value):
                    return f"old_per_token_logps[{i}] is {value}"
        return None


_FLOAT32_MAX = 3.4028234663852886e38


class ExperienceError(UserError, ValueError):
    """An experience that would corrupt the weights; the message names the agent and the experience."""


def check_experiences(agent: str, experiences: list[Experience]) -> None:
    """Raise one ExperienceError line for the first experience with a non-finite advantage or log-prob."""
    for i, experience in enumerate(experiences):
        problem = experience.problem()
        if problem is not None:
            raise ExperienceError(f"agent {agent!r}: experience {i}: {problem}; advantages and log-probs must be "
                                  "finite (a group with equal rewards has std 0: add an epsilon to the divisor)")


class UpdateRequest(_Message):
    experiences: list[Experience]


class OptimizerRequest(_Message):
    keep: bool
    """True: the agent updates soon, have its optimizer state resident (fetched in the background if released);
    False: release it until then (`orchestrator.memory_plan`)."""


class MemoryReading(_Message):
    """The peak memory of an agent's processes since the reading before (`agent_trainer.process_memory`)."""

    processes: list[int]
    """The pids read: one per data-parallel worker. Agents that share a host read the same process."""
    peak_bytes: int
    """Peak resident memory, summed over the processes (Linux: the high-water mark, reset at each reading;
    elsewhere the peak since the process started)."""
    device_peak_bytes: int | None = None
    """Peak memory torch allocated on the GPU, summed over the processes; None without one."""

    @classmethod
    def concat(cls, shares: list[MemoryReading]) -> MemoryReading:
        """One reading of workers' readings: their processes, their peaks summed."""
        device = [r.device_peak_bytes for r in shares if r.device_peak_bytes is not None]
        return cls(processes=[p for r in shares for p in r.processes], peak_bytes=sum(r.peak_bytes for r in shares),
                   device_peak_bytes=sum(device) if device else None)


class UpdateResult(_Message):
    agent: str
    policy_version: int
    """The agent's update count after this update: the version of the weights it leaves."""
    loss: float
    """Mean over the `num_iterations` passes."""
    grad_norm: float
    """Global gradient norm before clipping, mean over the passes (nan when a pass's gradient was not finite)."""
    kl: float
    entropy: float
    """Mean per-token entropy of the sampling distribution (temperature, top-k, top-p applied)."""
    clip_fraction: float
    lr: float
    num_tokens: int
    num_sequences: int
    seconds: float
    logp_mismatch: float | None = None
    """Mean |log pi(token) - behaviour log-prob| over tokens at the first pass: how far the trained policy is
    from the one that sampled (numerics, precision, a stale engine). None without behaviour log-probs."""
    skipped_steps: int = 0
    """Optimizer steps skipped because the loss or the gradient was not finite; the weights did not move."""
    logp_gap_max: float | None = None
    """Largest |log pi(token) - behaviour log-prob| over the batch's tokens at the first pass (logp_mismatch is
    the mean). None without behaviour log-probs."""
    tis_weight: float | None = None
    """Mean truncated importance weight min(exp(trainer - behaviour log-prob), tis_cap) over tokens; None: off."""
    tis_truncated: float | None = None
    """Fraction of tokens whose importance weight was cut to tis_cap; None: off."""
    sync_seconds: float = 0.0
    """Seconds spent after the update putting the new weights into the agent's rollout engine (0 for hf)."""


class ValueRequest(_Message):
    """Inputs for a critic to value (`agent_trainer.critic`): text the coordinator wrote from episodes' turns."""

    states: list[str]


class ValueResult(_Message):
    critic: str
    values: list[float]
    """One value per state, in order."""
    seconds: float


class ValueTarget(_Message):
    """One state a critic learns to value: its input, the value it had at rollout, and the GAE return."""

    state: str
    old_value: float
    """The critic's value of `state` when the step's advantages were computed (the clipping anchor)."""
    target: float
    """The lambda-return: the GAE advantage plus `old_value`."""


class CriticUpdateRequest(_Message):
    targets: list[ValueTarget]


class CriticUpdateResult(_Message):
    critic: str
    version: int
    """The critic's update count after this update."""
    value_loss: float
    """Mean over the passes of PPO's value loss, 0.5 * squared error (the larger of clipped and unclipped)."""
    value_clip_fraction: float
    """Share of the targets whose clipped error was the larger, mean over the passes."""
    explained_variance: float
    """1 - Var(target - old value) / Var(target) over the batch, before the update: 1 is a perfect critic, 0
    no better than a constant, below 0 worse."""
    grad_norm: float
    lr: float
    num_states: int
    skipped_steps: int = 0
    seconds: float


class CheckpointInfo(_Message):
    agent: str
    path: str
    policy_version: int
    """The agent's update count in the checkpoint."""


class ScoreRequest(_Message):
    experiences: list[Experience]
    """Completions to score: their prompt and completion tokens (advantages are not used)."""
    engine: bool = False
    """Score with the rollout engine instead of the learner's model."""


class WeightDigests(_Message):
    """SHA-256 of an agent's weights, in two parts: the base model and its own adapter ("" for a full-model
    agent, whose weights are all `base`)."""

    base: str
    adapter: str


class StoredFiles(_Message):
    """What a trainer wrote for one checkpoint: its files, named relative to its agent directory."""

    files: dict[str, str]
    """File name -> SHA-256 of its bytes, computed on the trainer's node as it wrote or uploaded them."""
    sizes: dict[str, int]
    """File name -> size in bytes (what the coordinator checks storage against before it commits)."""


# ----------------------------------------------------------------------------------- checkpoint store
DEFAULT_STORE_DEADLINE_S = 120.0
"""Seconds any one call to the checkpoint store may take where no run's `train.storage_timeout_s` says (its default
too)."""


@dataclass(frozen=True)
class Location:
    """A directory in the checkpoint store: `root`, a filesystem URI (`s3://bucket/prefix`, `gs://...`,
    `hdfs://...`, `file:///path`, or an absolute path, which is a `file://` location), and a `/`-separated
    `key` below it. The run directory's checkpoints are one (its absolute path); `train.storage` names
    another. Behaves like a path where the coordinator needs one: `loc / "agents"`, `loc.name`, `loc.parent`,
    `str(loc)` (the URI). `agent_trainer/storage.py` reads and writes it.

    A location carries the deadline of every call to the store made for it (`deadline_s`, the run's
    `train.storage_timeout_s`; None waits forever), and hands it to every location derived from it, so a trainer
    keeps the deadline of the requests it is sent. Two locations of the same place are equal whatever their deadline."""

    root: str
    key: str = ""
    deadline_s: float | None = field(default=DEFAULT_STORE_DEADLINE_S, compare=False)

    @classmethod
    def parse(cls, uri: str | PurePath, deadline_s: float | None = DEFAULT_STORE_DEADLINE_S) -> Location:
        """The location a URI names; a path (str or Path) is made absolute (a `file://` location)."""
        text = str(uri)
        if "://" not in text:
            text = os.path.abspath(text)
        return cls(text.rstrip("/") or "/", deadline_s=deadline_s)

    def __truediv__(self, part: str) -> Location:
        return Location(self.root, f"{self.key}/{part}".strip("/"), self.deadline_s)

    @property
    def name(self) -> str:
        return (self.key or self.root.rstrip("/")).rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        return Location(self.root, self.key.rsplit("/", 1)[0] if "/" in self.key else "", self.deadline_s)

    def __str__(self) -> str:
        return f"{self.root.rstrip('/')}/{self.key}" if self.key else self.root


class ForwardedEnv(_Message):
    values: dict[str, SecretStr] = {}
    """`ray.forward_env`: each variable's value as the coordinator's environment has it, set in a trainer's process
    as it starts. Passed as an argument of the trainer's constructor, never in Ray's `runtime_env`, whose agent logs
    what it is given; printed, it shows `**********` for every value."""

    def apply(self) -> None:
        """Set the variables in this process's environment."""
        os.environ.update({name: value.get_secret_value() for name, value in self.values.items()})


class SaveRequest(_Message):
    target: Location
    """The agent's directory of the checkpoint being written."""


class LoadRequest(_Message):
    source: Location
    """The agent's directory of the checkpoint to load."""
    files: dict[str, str] | None = None
    """File name (relative to `source`) -> SHA-256 from the checkpoint's manifest: every file is checked
    against it before anything is loaded. None: a directory given by hand, loaded as it is."""


class ProbeRequest(_Message):
    where: Location
    """Where the coordinator wrote the probe file (the run's checkpoint directory in the store)."""
    token: str
    agent: str
    """The agent whose answer is written beside the probe."""
