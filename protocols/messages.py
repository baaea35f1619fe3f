"""Typed messages that cross the boundary between the coordinator and a trainer process."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

ChatMessage = dict[str, str]
Prompt = str | list[ChatMessage]
"""A plain text prompt, or chat messages ({"role": ..., "content": ...}) for the chat template."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerateRequest(_Message):
    prompts: list[Prompt]
    """One prompt per completion wanted; repeat a prompt for several samples of it."""
    seed: int
    """Seeds the sampling, so a request replays exactly."""
    max_completion_length: int | None = None
    """Overrides the agent's setting for this request."""
    temperature: float | None = Field(None, gt=0.0)
    """Overrides the agent's setting for this request."""


class Completion(_Message):
    text: str
    """Decoded completion, up to and without the end-of-sequence token."""
    prompt_ids: list[int]
    """Prompt tokens the model saw (after chat template and truncation)."""
    completion_ids: list[int]
    """Sampled tokens, the end-of-sequence token included when sampled; no padding."""
    per_token_logps: list[float]
    """Log-probability of each completion token under the sampling policy."""
    finish_reason: Literal["stop", "length"]
    """`stop`: ended with end-of-sequence; `length`: hit max_completion_length."""
    prompt_truncated: bool = False
    """The prompt was longer than max_prompt_length and lost its start."""


class GenerateResult(_Message):
    agent: str
    completions: list[Completion]
    seconds: float


class Experience(_Message):
    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    """Scalar advantage given to every token of this completion."""
    old_per_token_logps: list[float] | None = None
    """Log-probs at sampling time; used for the importance ratio when num_iterations > 1."""

    @classmethod
    def from_completion(cls, completion: Completion, advantage: float) -> Experience:
        return cls(prompt_ids=completion.prompt_ids, completion_ids=completion.completion_ids,
                   advantage=advantage, old_per_token_logps=completion.per_token_logps)


class UpdateRequest(_Message):
    experiences: list[Experience]


class UpdateResult(_Message):
    agent: str
    step: int
    """The agent's update count after this update."""
    loss: float
    grad_norm: float
    kl: float
    entropy: float
    clip_fraction: float
    lr: float
    num_tokens: int
    num_sequences: int
    seconds: float


class CheckpointInfo(_Message):
    agent: str
    path: str
    step: int
