"""Rollout engines: what samples an agent's completions from its policy weights.

An agent is three things in `agent_trainer/`: its policy weights (the learner's model, float32 master
copy for a trainable agent), a rollout engine that samples from them, and the learner that updates them
(`agent_trainer.trainer.AgentTrainer`, which is also the agent's facade). The engine is chosen per agent
with `agents.NAME.rollout.engine`:

- `hf` (`HFEngine`): marsi's own decode loop (`agent_trainer.sampling.sample`) on the learner's model
  itself. It holds no copy of the weights, so `sync` only points it at the model (a new object after
  `load`).
- `vllm` (`agent_trainer.engine_vllm.VLLMEngine`): a vLLM engine colocated in the agent's process, on the
  agent's device, holding its own copy of the weights; `sync` copies the learner's weights into it.

Both return, per prompt, the sampled token ids (the stop token included when sampled), the log-prob of
each under the distribution it was sampled from (temperature, then top-k, then top-p, renormalised:
`agent_trainer.sampling`), and whether the completion stopped or ran out of length. The learner calls
`sleep()` before an update (an engine that shares a GPU frees its memory) and `sync(model)` after it and
after a checkpoint is loaded, so an engine always samples from the learner's current weights.
`agent_trainer.engine_kinds.make_engine` makes the one an agent names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ContextManager, Literal, Protocol

import torch

from agent_trainer import sampling


@dataclass(frozen=True)
class Rollout:
    """One sampled completion, as an engine returns it."""

    completion_ids: list[int]
    """Sampled tokens; the stop token included when one was sampled."""
    per_token_logps: list[float]
    """Behaviour log-prob of each sampled token (the distribution it was sampled from)."""
    finish_reason: Literal["stop", "length"]


class RolloutEngine(Protocol):
    """What the learner needs from an engine; `HFEngine` and `VLLMEngine` implement it."""

    name: str
    """`hf` or `vllm`."""

    def generate(self, prompt_ids: list[list[int]], *, max_new_tokens: int, temperature: float,
                 seed: int, first_row: int = 0, total_rows: int | None = None) -> list[Rollout]:
        """One completion per prompt; the same `seed` and prompts replay the same completions. The prompts
        are rows `first_row` onward of a request of `total_rows` rows (default: all of it), and each row
        samples as it would in the whole request (a data-parallel agent's workers each decode a share)."""

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        """Log-prob of each completion token under the engine's weights, full softmax at temperature 1:
        for checking that the engine holds the learner's weights."""

    def sleep(self) -> None:
        """The learner is about to update: free what the engine holds on a shared GPU (a no-op elsewhere)."""

    def sync(self, model: torch.nn.Module) -> None:
        """Sample from `model`'s current weights from now on (wakes a sleeping engine)."""

    def close(self) -> None:
        """Release the engine."""


class HFEngine:
    """marsi's decode loop on the learner's own model: no weight copy, nothing to sync but the reference."""

    name = "hf"

    def __init__(self, model: torch.nn.Module, *, top_k: int, top_p: float, stop_ids: list[int], pad_id: int,
                 device: torch.device, autocast: Callable[[], ContextManager]):
        self.model, self.top_k, self.top_p, self.stop_ids, self.pad_id = model, top_k, top_p, stop_ids, pad_id
        self.device, self.autocast = device, autocast

    def generate(self, prompt_ids: list[list[int]], *, max_new_tokens: int, temperature: float,
                 seed: int, first_row: int = 0, total_rows: int | None = None) -> list[Rollout]:
        ids, mask = left_pad(prompt_ids, self.pad_id, self.device)
        generator = torch.Generator(self.device).manual_seed(seed)
        # no_grad, not inference_mode: autocast casts each weight once per call only outside inference mode
        # (benchmarks/sampling_parts.py, "decode step, bf16": 0.38-0.47x inference_mode's time on SmolLM2)
        with torch.no_grad(), self.autocast():
            completion_ids, lengths, per_token_logps = sampling.sample(
                self.model, ids, mask, temperature=temperature, top_k=self.top_k, top_p=self.top_p,
                max_new_tokens=max_new_tokens, stop_ids=self.stop_ids, pad_id=self.pad_id, generator=generator,
                first_row=first_row, total_rows=total_rows)
        completion_ids, lengths, per_token_logps = completion_ids.tolist(), lengths.tolist(), per_token_logps.tolist()
        rollouts = []
        for i, n in enumerate(lengths):
            row = completion_ids[i][:n]
            rollouts.append(Rollout(completion_ids=row, per_token_logps=per_token_logps[i][:n],
                                    finish_reason="stop" if row[-1] in self.stop_ids else "length"))
        return rollouts

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        with self.autocast():
            return model_logps(self.model, prompt_ids, completion_ids, self.device)

    def sleep(self) -> None:
        pass

    def sync(self, model: torch.nn.Module) -> None:
        self.model = model

    def close(self) -> None:
        self.model = None


def left_pad(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def model_logps(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                device) -> list[list[float]]:
    """Log-prob of each completion token under `model`'s full softmax at temperature 1, one sequence at a time."""
    out = []
    for prompt, completion in zip(prompt_ids, completion_ids):
        ids = torch.tensor([prompt + completion], device=device)
        logits = model(input_ids=ids, logits_to_keep=len(completion) + 1).logits[0, :-1].float()  # (T, V)
        out.append(logits.log_softmax(-1).gather(1, ids[0, len(prompt):, None]).squeeze(1).tolist())
    return out
