"""Pure tensor functions for policy-gradient training of language models.

Shapes: B sequences, T completion tokens (padded), V vocabulary.

- `clipped_policy_loss` is PPO's clipped surrogate per token (Schulman et al., 2017) with one scalar
  advantage per sequence, as GRPO. When the old log-probs are the detached current ones (one pass
  over the batch), the ratio is 1 and the gradient equals REINFORCE with the advantage.
- `truncated_importance_weights` is truncated importance sampling (TIS; Yao et al., 2025, "Your efficient
  RL framework secretly brings you off-policy RL training"; verl's rollout correction): a rollout engine
  (vLLM) samples with kernels and precision that differ from the learner's, so its behaviour log-probs
  mu(token) differ from the learner's pi_old(token) for the same weights. Each token's policy-gradient
  term is weighted by w = min(pi_old / mu, cap), detached, with pi_old the learner's log-prob before the
  update (the first pass's). Departure: the weight is per token and truncated from above only (no
  sequence-level product, no masking of tokens with w < 1/cap), as the token-level TIS variant.
- `kl_k3` is Schulman's k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1, as GRPO.
- `aggregate_loss`: `token` averages over every completion token of the whole batch (DAPO, Yu et
  al., 2025), normalised by the batch's total tokens so gradient accumulation over micro-batches gives
  the same gradient as one big batch; `sequence` averages per sequence then over sequences (GRPO).
- `value_loss` is PPO's value loss (Schulman et al., 2017; the clipped form of OpenAI baselines' ppo2):
  0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per state, R the lambda-return; without a
  clip range the plain 0.5 * (V - R)^2.
- Log-probs and entropies are those of the sampling distribution: the trainer takes them from
  `agent_trainer.sampling.token_logps` (temperature, top-k, top-p; -inf for a cut candidate), whose
  candidate logits go to `entropy_from_logits`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1; over everything, or along `dim`."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T) entropy of the (B, T, V) categorical distributions; -inf logits are tokens with probability 0."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp.masked_fill(torch.isneginf(logp), 0.0)).sum(-1)


def kl_k3(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """(B, T) k3 estimate of KL(pi || pi_ref) per token; >= 0, unbiased under samples of pi."""
    delta = ref_per_token_logps - per_token_logps
    return torch.exp(delta) - delta - 1.0


def truncated_importance_weights(old_per_token_logps: torch.Tensor, behaviour_per_token_logps: torch.Tensor,
                                 cap: float) -> torch.Tensor:
    """(B, T) min(exp(old - behaviour), cap), detached: the learner's probability of each sampled token over the
    engine's, truncated at `cap` (an overflowing ratio becomes `cap`)."""
    return torch.exp(old_per_token_logps.detach() - behaviour_per_token_logps.detach()).clamp(max=cap)


def clipped_policy_loss(per_token_logps: torch.Tensor, old_per_token_logps: torch.Tensor,
                        advantages: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) per-token clipped surrogate loss (to minimise) and (B, T) bool where clipping was active."""
    ratio = torch.exp(per_token_logps - old_per_token_logps)  # (B, T)
    adv = advantages.unsqueeze(1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon) * adv
    return -torch.min(unclipped, clipped), clipped < unclipped


def aggregate_loss(per_token_loss: torch.Tensor, completion_mask: torch.Tensor, mode: str,
                   total_tokens: float, total_sequences: float) -> torch.Tensor:
    """Scalar loss of one micro-batch, normalised by the whole batch's token or sequence count."""
    mask = completion_mask.to(per_token_loss.dtype)
    if mode == "token":
        return (per_token_loss * mask).sum() / max(total_tokens, 1.0)
    if mode == "sequence":
        per_seq = (per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1.0)  # (B,)
        return per_seq.sum() / max(total_sequences, 1.0)
    raise ValueError(f"loss_aggregation must be 'token' or 'sequence', got {mode!r}")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per state (B,), and (B,) whether the clipped error was the larger (it then holds the
    loss). values, old_values, returns: (B,)."""
    unclipped = (values - returns) ** 2  # (B,)
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    moved = old_values + (values - old_values).clamp(-clip, clip)  # (B,)
    clipped = (moved - returns) ** 2  # (B,)
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
