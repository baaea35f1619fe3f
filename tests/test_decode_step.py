"""The static-cache decode steps sample what transformers' forward and the earlier exponential race sample.

`reference_sample` is `sampling.sample` as it was before `decode_step.StaticDecoder`: the model's own forward at
every step (a DynamicCache grown by concatenation), the noise -log u and argmax(p / noise). The decode loop
must give the same tokens and the same log-probs bit for bit, for every share of a request."""

import contextlib

import pytest
import torch

from agent_trainer import decode_step, sampling, shared_prompts
from agent_trainer.engines import left_pad
from agent_trainer.models import load_model

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16], [11, 12], [17]]


@torch.no_grad()
def reference_sample(model, prompt_ids, prompt_mask, *, max_new_tokens, temperature, top_k, top_p, stop_ids,
                     pad_id, generator, first_row=0, total_rows=None):
    B = prompt_ids.size(0)
    total_rows = B if total_rows is None else total_rows
    cache_arg = shared_prompts.cache_argument(model)
    stop = torch.tensor(stop_ids)
    distinct_ids, distinct_mask, index = shared_prompts.distinct_rows(prompt_ids, prompt_mask)
    logits, cache = shared_prompts.prefill(model, distinct_ids, distinct_mask, index)
    attention_mask = prompt_mask
    position_ids = shared_prompts.positions(prompt_mask)[:, -1:]
    done = torch.zeros(B, dtype=torch.bool)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long)
    tokens, logps = [], []
    for t in range(max_new_tokens):
        values, ids = sampling.candidates(logits[:, -1, :], temperature, top_k, top_p)
        logp = values.log_softmax(-1)
        uniform = torch.empty(total_rows, logits.size(-1), dtype=torch.float64)
        uniform = uniform.uniform_(generator=generator)[first_row:first_row + B]
        noise = -(uniform if ids is None else uniform.gather(1, ids)).log()
        pick = (logp.exp() / noise).argmax(-1)
        token = (pick if ids is None else ids.gather(1, pick.unsqueeze(1)).squeeze(1)).masked_fill(done, pad_id)
        tokens.append(token)
        logps.append(logp.gather(1, pick.unsqueeze(1)).squeeze(1).masked_fill(done, 0.0))
        stopped = ~done & torch.isin(token, stop)
        lengths = torch.where(stopped, t + 1, lengths)
        done |= stopped
        if bool(done.all()) or t + 1 == max_new_tokens:
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
        position_ids = position_ids + 1
        out = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        logits, cache = out.logits, out[cache_arg]
    return torch.stack(tokens, 1), lengths, torch.stack(logps, 1)


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("builtin:tiny")
    return model.eval()


@pytest.fixture(scope="module")
def smollm2():
    model, _ = load_model("builtin:smollm2-135m-instruct")
    return model.eval()


def both(model, prompts, *, autocast=contextlib.nullcontext, **kwargs):
    ids, mask = left_pad(prompts, pad=0, device="cpu")
    outs = []
    for sample in (sampling.sample, reference_sample):
        with torch.no_grad(), autocast():
            outs.append(sample(model, ids, mask, generator=torch.Generator().manual_seed(3), pad_id=0, **kwargs))
    return outs


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (20, 0.9)])
def test_static_decoder_samples_the_reference_tokens_and_logps_bit_for_bit(tiny, top_k, top_p):
    assert decode_step.supports(tiny)
    (tokens, lengths, logps), (ref_tokens, ref_lengths, ref_logps) = both(
        tiny, PROMPTS, max_new_tokens=12, temperature=0.8, top_k=top_k, top_p=top_p, stop_ids=[1])
    assert tokens.size(1) > 1 and (logps != 0).any()
    assert torch.equal(tokens, ref_tokens) and torch.equal(lengths, ref_lengths)
    assert torch.equal(logps, ref_logps)


def test_a_share_of_a_request_and_unpadded_prompts_sample_as_the_reference(tiny):
    prompts = [[5, 6, 7], [8, 9, 10], [5, 6, 7]]  # no padding: transformers passes SDPA no mask
    outs = both(tiny, prompts, max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0, stop_ids=[],
                first_row=2, total_rows=7)
    for new, ref in zip(*outs):
        assert torch.equal(new, ref)


def test_bf16_autocast_decodes_as_the_forward(tiny):
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731
    outs = both(tiny, PROMPTS, autocast=autocast, max_new_tokens=8, temperature=0.7, top_k=0, top_p=1.0,
                stop_ids=[])
    for new, ref in zip(*outs):
        assert torch.equal(new, ref)


def test_smollm2_decodes_as_the_forward(smollm2):
    assert decode_step.supports(smollm2)
    outs = both(smollm2, [[1, 504, 3136, 28], [1, 4093, 314, 260, 1345, 28]] * 2, max_new_tokens=10,
                temperature=1.0, top_k=0, top_p=1.0, stop_ids=[])
    for new, ref in zip(*outs):
        assert torch.equal(new, ref)


def test_a_model_with_other_modules_in_its_projections_takes_the_forward(tiny):
    class Wrapped(torch.nn.Linear):
        pass

    q_proj = tiny.model.layers[0].self_attn.q_proj
    wrapped = Wrapped(q_proj.in_features, q_proj.out_features, bias=False)
    wrapped.weight = q_proj.weight
    tiny.model.layers[0].self_attn.q_proj = wrapped
    try:
        assert not decode_step.supports(tiny)
    finally:
        tiny.model.layers[0].self_attn.q_proj = q_proj
    assert decode_step.supports(tiny)
