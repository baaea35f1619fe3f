"""The loss and sampling-distribution maths against values computed by hand or densely in float64."""

import math

import pytest
import torch

from agent_trainer import losses, sampling
from orchestrator import advantages


def test_masked_mean_ignores_masked_values():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert losses.masked_mean(values, mask).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3
    assert losses.masked_mean(values, mask, dim=1).tolist() == pytest.approx([1.5, 3.0])


def test_group_relative_advantages_by_hand():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0]
    groups = [7, 7, 3, 3, (5, "any hashable")]
    centred = advantages.group_relative_advantages(rewards, groups, scale=False)
    assert centred == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0])
    scaled = advantages.group_relative_advantages(rewards, groups, scale=True, eps=0.0 + 1e-4)
    # group 7: mean 0.5, population std 0.5 -> +-1; zero-std groups and singletons give 0
    assert scaled == pytest.approx([0.5 / 0.5001, -0.5 / 0.5001, 0.0, 0.0, 0.0], rel=1e-6)


def test_discounted_returns_by_hand():
    assert advantages.discounted_returns([0.0, 0.0, 1.0], 0.5) == pytest.approx([0.25, 0.5, 1.0])
    assert advantages.discounted_returns([1.0, 2.0], 1.0) == pytest.approx([3.0, 2.0])


def test_ema_baseline_by_hand():
    adv, b = advantages.ema_advantages(0.0, [1.0, 0.0], decay=0.5)
    assert adv == pytest.approx([1.0, 0.0])  # every return against the baseline from before the batch
    assert b == pytest.approx(0.25 * 0.0 + 0.75 * 0.5)  # decay**2 on the old baseline, the rest on the batch mean
    adv, b2 = advantages.ema_advantages(b, [1.0], decay=0.5)
    assert adv == pytest.approx([1.0 - b]) and b2 == pytest.approx(0.5 * b + 0.5)
    _, one_order = advantages.ema_advantages(0.3, [2.0, -1.0, 0.5], 0.9)
    _, other_order = advantages.ema_advantages(0.3, [0.5, 2.0, -1.0], 0.9)
    assert one_order == pytest.approx(other_order)


def test_token_logps_without_truncation_is_the_tempered_full_log_softmax():
    logits = torch.randn(2, 3, 7)
    index = torch.randint(0, 7, (2, 3))
    full = torch.log_softmax(logits / 0.7, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    logps, candidate_logits = sampling.token_logps(logits, index, 0.7)
    assert torch.allclose(logps, full, atol=1e-6)
    assert candidate_logits.shape == (2, 3, 7)


def dense_reference(logits, tokens, temperature, top_k, top_p):
    """float64 log-probs over the whole vocabulary: tempered, cut below the k-th value (ties kept), then top-p
    (a token is cut when the tokens with a strictly larger logit hold top_p of the mass: ties stay together), the
    token put back if cut."""
    z = logits.double() / temperature
    kth = z.topk(top_k, dim=-1).values[..., -1:]
    z = z.masked_fill(z < kth, float("-inf"))
    probs = z.softmax(-1)
    above = (probs.unsqueeze(-2) * (z.unsqueeze(-2) > z.unsqueeze(-1))).sum(-1)  # (..., V): mass strictly above
    cut = above >= top_p
    z = z.masked_fill(cut, float("-inf")).scatter(-1, tokens.unsqueeze(-1), (logits.double() / temperature).gather(
        -1, tokens.unsqueeze(-1)))
    return z.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_top_k_candidates_give_the_whole_vocabulary_log_probs_with_ties_and_tokens_outside_the_set(top_p):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 300, generator=generator).mul(3).round().div(2)  # coarse values: many ties
    tokens = torch.randint(0, 300, (4, 5), generator=generator)  # mostly outside the top 10
    tokens[0, 0] = logits[0, 0].argmax()
    logps, candidate_logits = sampling.token_logps(logits, tokens, 0.9, top_k=10, top_p=top_p)
    assert torch.allclose(logps.double(), dense_reference(logits, tokens, 0.9, 10, top_p), atol=1e-5)
    kth = logits.topk(10, dim=-1).values[..., -1:]
    assert candidate_logits.size(-1) == int((logits >= kth).sum(-1).max()) + 1 > 11  # ties kept, plus the token
    assert torch.isfinite(candidate_logits).sum(-1).min() >= 1


@pytest.mark.parametrize("top_k", [0, 4])  # 4: the tie at the 4th value brings in the 5th
def test_top_p_keeps_or_cuts_a_tie_whole_whatever_the_vocabulary_order(top_k):
    # masses 0.4, 0.2, 0.2, 0.1, 0.1: at top_p 0.5 the two tied 0.2 tokens stay together (0.8 kept, not 0.6)
    logits = torch.tensor([0.4, 0.2, 0.2, 0.1, 0.1]).log()
    for order in ([0, 1, 2, 3, 4], [2, 4, 0, 1, 3], [4, 3, 2, 1, 0]):
        values, ids = sampling.candidates(logits[order], 1.0, top_k=top_k, top_p=0.5)
        ids = torch.tensor(order)[ids] if ids is not None else torch.tensor(order)
        kept = set(ids[torch.isfinite(values)].tolist())
        assert kept == {0, 1, 2}


def test_entropy_of_uniform_and_certain():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    assert losses.entropy_from_logits(logits)[0].tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


def test_kl_k3_by_hand():
    logp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]])
    # k3 = r - log r - 1 with r = p_ref / p: r=0.5 -> 0.5 + log 2 - 1; r=1 -> 0
    assert losses.kl_k3(logp, ref)[0].tolist() == pytest.approx([0.5 + math.log(2) - 1.0, 0.0], abs=1e-6)


def test_clipped_policy_loss_by_hand():
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]]))
    adv = torch.tensor([1.0, -1.0])
    loss, clipped = losses.clipped_policy_loss(new, old, adv, epsilon=0.2)
    # A>0: min(1.5, 1.2) = 1.2 (clipped), min(0.5, 0.8) = 0.5; A<0: min(-1.5, -1.2) = -1.5, min(-0.5, -0.8) = -0.8 (clipped)
    assert loss.flatten().tolist() == pytest.approx([-1.2, -0.5, 1.5, 0.8])
    assert clipped.tolist() == [[True, False], [False, True]]


def test_ratio_one_gives_reinforce_gradient():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = losses.clipped_policy_loss(logp, logp.detach(), torch.tensor([2.0]), epsilon=0.2)
    loss.sum().backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-2.0, -2.0])


def test_aggregate_loss_token_and_sequence():
    per_token = torch.tensor([[1.0, 1.0, 7.0], [4.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # the 7s are padding after EOS
    assert losses.aggregate_loss(per_token, mask, "token", 3, 2).item() == pytest.approx(6.0 / 3)
    assert losses.aggregate_loss(per_token, mask, "sequence", 3, 2).item() == pytest.approx((1.0 + 4.0) / 2)


def test_token_loss_over_micro_batches_equals_one_batch():
    per_token = torch.rand(4, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    total = float(mask.sum())
    whole = losses.aggregate_loss(per_token, mask, "token", total, 4)
    parts = sum(losses.aggregate_loss(per_token[i:i + 2], mask[i:i + 2], "token", total, 4) for i in (0, 2))
    assert parts.item() == pytest.approx(whole.item())


def test_padding_after_eos_gets_no_gradient_and_last_token_does():
    mask = torch.tensor([[1, 1, 0, 0]])  # a completion of two tokens, the last its EOS, then padding
    logp = torch.zeros(1, 4, requires_grad=True)
    per_token, _ = losses.clipped_policy_loss(logp, logp.detach(), torch.tensor([1.0]), 0.2)
    losses.aggregate_loss(per_token, mask, "token", float(mask.sum()), 1).backward()
    assert logp.grad[0, :2].abs().min() > 0  # the EOS, the last real token, is trained on
    assert logp.grad[0, 2:].abs().max() == 0  # padding after it is not


def test_truncated_importance_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    behaviour = torch.tensor([[-1.0, -1.0, -3.0]])
    weights = losses.truncated_importance_weights(old, behaviour, cap=2.0)
    assert weights[0].tolist() == pytest.approx([1.0, math.exp(-1.0), 2.0])  # exp(2.5) > 2 is cut to the cap
    overflow = losses.truncated_importance_weights(torch.tensor([0.0]), torch.tensor([-1e4]), cap=3.0)
    assert overflow.tolist() == [3.0]
    assert not losses.truncated_importance_weights(old.requires_grad_(), behaviour, 2.0).requires_grad


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (5, 0.8), (0, 0.8)])
def test_a_nan_logit_makes_only_its_own_position_nan(top_k, top_p):
    # the update refuses a non-finite loss; a NaN must neither vanish nor spread to other positions
    logits = torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0))
    logits[0, 1, 7] = float("nan")
    tokens = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(1))
    logps, _ = sampling.token_logps(logits, tokens, 0.9, top_k=top_k, top_p=top_p)
    assert torch.isnan(logps[0, 1])
    finite = torch.ones(2, 3, dtype=torch.bool)
    finite[0, 1] = False
    assert torch.isfinite(logps[finite]).all()
