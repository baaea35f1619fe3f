"""Pure tensor functions for policy-gradient training of language models.

Shapes: B sequences, T completion tokens (padded), V vocabulary.

- `group_relative_advantages` follows GRPO (Shao et al., 2024, "DeepSeekMath"): reward minus the
  mean of its group, divided by the group's std when `scale` (GRPO) or not (Dr. GRPO, Liu et al.,
  2025). Departures: groups are given by arbitrary integer ids, so groups may differ in size
  (episodes that ended early, per-(agent, turn) groups); the std is the population std (ddof=0),
  so a group of one gets advantage 0 instead of NaN; `eps` guards a zero std.
- `ema_update` is the per-role moving-average baseline of SPIRAL's role-conditioned advantage
  estimation (Liu et al., 2025): advantage = return - b_role, then b_role <- decay*b_role + (1-decay)*return.
  Departure: none beyond taking the baseline *before* folding in the current batch's returns.
- `clipped_policy_loss` is PPO's clipped surrogate per token (Schulman et al., 2017) with one scalar
  advantage per sequence, as GRPO. When the old log-probs are the detached current ones (one pass
  over the batch), the ratio is 1 and the gradient equals REINFORCE with the advantage.
- `kl_k3` is Schulman's k3 estimator of KL(pi || pi_ref): exp(ref - logp) - (ref - logp) - 1, as GRPO.
- `aggregate_loss`: `token` averages over every completion token of the whole batch (DAPO, Yu et
  al., 2025), normalised by the batch's total tokens so gradient accumulation over micro-batches gives
  the same gradient as one big batch; `sequence` averages per sequence then over sequences (GRPO).
- `completion_mask_from_ids` keeps every token up to and including the first EOS and drops all
  padding after it, so pad-after-EOS never enters the loss and the last real token always does.
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


def completion_mask_from_ids(completion_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B, T) int mask: 1 up to and including the first EOS of each row, 0 after it."""
    is_eos = completion_ids == eos_token_id  # (B, T)
    T = completion_ids.size(1)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(is_eos[:, 0], T, dtype=torch.long))
    positions = torch.arange(T, device=completion_ids.device).expand_as(completion_ids)  # (B, T)
    return (positions <= first_eos.unsqueeze(1)).int()


def group_relative_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, scale: bool = True,
                              eps: float = 1e-4) -> torch.Tensor:
    """(B,) advantages: reward minus its group's mean, divided by the group's std when `scale`."""
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (B,)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, torch.ones_like(rewards))
    mean = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, rewards) / count  # (G,)
    centred = rewards - mean[inverse]  # (B,)
    if not scale:
        return centred
    var = torch.zeros(num_groups, dtype=rewards.dtype).index_add_(0, inverse, centred**2) / count
    return centred / (var.sqrt()[inverse] + eps)


def ema_update(baseline: float | None, returns: list[float], decay: float) -> tuple[list[float], float]:
    """Advantages of `returns` against an EMA baseline (starting at the first return), and the new baseline."""
    if not returns:
        return [], baseline if baseline is not None else 0.0
    b = returns[0] if baseline is None else baseline
    advantages = [r - b for r in returns]
    for r in returns:
        b = decay * b + (1.0 - decay) * r
    return advantages, b


def discounted_returns(rewards: list[float], discount: float) -> list[float]:
    """Return per turn: G_t = r_t + discount * G_{t+1}."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + discount * running
        out[t] = running
    return out


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, T) log-softmax of (B, T, V) `logits` gathered at (B, T) `index`, without a (B, T, V) log-softmax copy."""
    picked = torch.gather(logits, -1, index.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T) entropy of the (B, T, V) categorical distributions."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def kl_k3(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """(B, T) k3 estimate of KL(pi || pi_ref) per token; >= 0, unbiased under samples of pi."""
    delta = ref_per_token_logps - per_token_logps
    return torch.exp(delta) - delta - 1.0


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
