"""The written-out attention for short CPU attentions gives SDPA's outputs and gradients."""

import pytest
import torch

from agent_trainer import attention
from agent_trainer.models import load_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward


class Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 3


def inputs(B=2, H=6, L=5, S=7, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g).requires_grad_() for h, n in ((H, L), (H // 3, S), (H // 3, S)))
    return q, k, v


def both(q, k, v, mask, **kw):
    results = []
    for fn in (sdpa_attention_forward, attention.attention_forward):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, _ = fn(Layer(), qq, kk, vv, mask, **kw)
        out.pow(2).sum().backward()
        results.append((out, qq.grad, kk.grad, vv.grad))
    return results


@pytest.mark.parametrize("case", ["padded", "causal", "decode"])
def test_matches_sdpa_outputs_and_gradients(case):
    if case == "padded":  # a left-padded row and a key block from a shared prompt
        q, k, v = inputs(L=5, S=7)
        mask = torch.ones(2, 1, 5, 7, dtype=torch.bool).tril(2)
        mask[1, :, :, :2] = False
    elif case == "causal":  # no mask: SDPA's is_causal
        q, k, v = inputs(L=6, S=6)
        mask = None
    else:  # a decode step: one query against the cache, some rows left-padded
        q, k, v = inputs(L=1, S=9)
        mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
        mask[0, :, :, :3] = False
    (out, *grads), (mine, *my_grads) = both(q, k, v, mask, scaling=0.3)
    assert mine.shape == out.shape
    assert torch.allclose(mine, out, atol=1e-5)
    for a, b in zip(my_grads, grads):
        assert torch.allclose(a, b, atol=1e-5)


def test_values_with_a_head_size_of_their_own():
    q, k, _ = inputs(L=4, S=6)
    v = torch.randn(2, 2, 6, 5, requires_grad=True)  # value heads of 5, query and key heads of 8
    mask = torch.ones(2, 1, 4, 6, dtype=torch.bool).tril(2)
    (out, *grads), (mine, *my_grads) = both(q, k, v, mask)
    assert mine.shape == out.shape == (2, 4, 6, 5)
    assert torch.allclose(mine, out, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(my_grads, grads))


def test_long_attentions_and_arguments_it_does_not_handle_go_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(1) or (None, None))
    q, k, v = inputs(L=4, S=4)
    attention.attention_forward(Layer(), q, k, v, None)
    assert calls == []
    attention.attention_forward(Layer(), q, k, v, None, softcap=50.0)  # softcapping: SDPA as before
    assert calls == [1]
    calls.clear()
    monkeypatch.setattr(attention, "MATH_ELEMENTS", 2 * 6 * 4 * 4 - 1)
    attention.attention_forward(Layer(), q, k, v, None)
    assert calls == [1]


def test_loaded_models_use_it_and_checkpoints_do_not_name_it(tmp_path):
    model, _ = load_model("builtin:tiny")
    assert model.config._attn_implementation == attention.NAME
    model.save_pretrained(tmp_path)
    assert attention.NAME not in (tmp_path / "config.json").read_text()
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        mine = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(mine[mask.bool()], sdpa[mask.bool()], atol=1e-5)
