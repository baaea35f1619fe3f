"""A prompt shared by several completions runs through the model once: same logits, same gradient, less work."""

import gc
import weakref

import pytest
import torch
from transformers import DynamicCache

from agent_trainer import sampling, shared_prompts
from agent_trainer.engines import left_pad
from agent_trainer.models import load_model
from agent_trainer.trainer import AgentTrainer, _collate
from protocols.config import AgentConfig, AlgorithmConfig
from protocols.messages import Experience, GenerateRequest, UpdateRequest

PROMPTS = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [11, 12], [5, 6, 7, 8, 9], [11, 12], [13, 14, 15]]
COMPLETIONS = [[20, 21, 22], [23], [24, 25, 26, 27], [28, 29], [30, 31], [32, 33, 34]]


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("builtin:tiny")
    return model.eval()


def batch_of(prompts, completions):
    exps = [Experience(prompt_ids=p, completion_ids=c, advantage=0.0) for p, c in zip(prompts, completions)]
    return _collate(exps, pad=0, temperature=1.0, device="cpu")


def logits_and_gradient(model, batch, weights):
    """(B, T, V) logits and d(sum of weighted completion log-probs)/d(parameters) through `completion_logits`."""
    model.zero_grad(set_to_none=True)
    logits = shared_prompts.completion_logits(model, batch.prompt_ids, batch.prompt_mask, batch.prompt_index,
                                              batch.completion_ids, batch.completion_mask)
    logps = logits.log_softmax(-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
    (logps * weights * batch.completion_mask).sum().backward()
    return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])


def test_distinct_rows_keeps_first_seen_order_and_tells_padding_from_a_real_pad_token():
    ids, mask = left_pad([[3, 4], [1, 2, 3], [3, 4], [0, 3, 4]], pad=0, device="cpu")
    distinct_ids, distinct_mask, index = shared_prompts.distinct_rows(ids, mask)
    assert index.tolist() == [0, 1, 0, 2]  # [0, 3, 4] with a real token 0 is not [3, 4] left-padded with 0
    assert distinct_ids.tolist() == [[0, 3, 4], [1, 2, 3], [0, 3, 4]]
    assert distinct_mask.tolist() == [[0, 1, 1], [1, 1, 1], [1, 1, 1]]


def test_shared_prompts_give_the_row_by_row_logits_and_gradient(tiny):
    shared = batch_of(PROMPTS, COMPLETIONS)
    assert shared.prompt_ids.size(0) == 3 and shared.prompt_index.tolist() == [0, 0, 1, 0, 1, 2]
    # the same rows with every prompt repeated: `completion_logits` takes the one-forward path
    unshared = shared._replace(prompt_ids=shared.prompt_ids.index_select(0, shared.prompt_index),
                               prompt_mask=shared.prompt_mask.index_select(0, shared.prompt_index),
                               prompt_index=torch.arange(len(PROMPTS)))
    weights = torch.randn(shared.completion_ids.shape, generator=torch.Generator().manual_seed(0))
    logits, grad = logits_and_gradient(tiny, shared, weights)
    reference_logits, reference_grad = logits_and_gradient(tiny, unshared, weights)
    mask = shared.completion_mask.bool()
    assert logits.shape == reference_logits.shape
    assert (logits[mask] - reference_logits[mask]).abs().max() < 1e-5
    assert (grad - reference_grad).norm() / reference_grad.norm() < 1e-5
    assert reference_grad.norm() > 0


def test_one_token_completions_need_only_the_prompts_forward(tiny):
    batch = batch_of([[5, 6, 7]] * 3, [[20], [21], [22]])
    logits = shared_prompts.completion_logits(tiny, batch.prompt_ids, batch.prompt_mask, batch.prompt_index,
                                              batch.completion_ids, batch.completion_mask)
    with torch.no_grad():
        expected = tiny(input_ids=torch.tensor([[5, 6, 7]])).logits[0, -1]
    assert logits.shape == (3, 1, expected.numel())
    assert (logits[:, 0] - expected).abs().max() < 1e-5


def test_the_model_runs_each_distinct_prompt_once_in_generation_and_update(tiny):
    """Tokens through the model's forward: a group of 4 completions of 2 prompts runs the prompts twice, not 8 times."""
    agent = AgentConfig(model="builtin:tiny", micro_batch_size=8, generation={"max_completion_length": 3})
    trainer = AgentTrainer("a", agent, AlgorithmConfig(), seed=0)
    seen = []
    trainer.model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].numel()),
                                            with_kwargs=True)
    prompt = "Say the letter q and nothing else, please."
    result = trainer.generate(GenerateRequest(prompts=[prompt, "Say b"] * 4, seed=3))
    lengths = {len(c.prompt_ids) for c in result.completions}
    assert seen[0] == 2 * max(lengths)  # prefill: 2 distinct prompts, left-padded to the longer
    seen.clear()
    exps = [Experience(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, advantage=a,
                       old_per_token_logps=c.per_token_logps) for c, a in zip(result.completions, [1.0, -1.0] * 4)]
    trainer.update(UpdateRequest(experiences=exps))
    longest = max(len(c.completion_ids) for c in result.completions)
    assert seen == [2 * max(lengths), 8 * (longest - 1)] if longest > 1 else seen == [2 * max(lengths)]


def test_decode_with_shared_prefill_matches_the_teacher_forced_log_probs(tiny):
    ids, mask = left_pad(PROMPTS, pad=0, device="cpu")
    with torch.no_grad():
        tokens, lengths, logps = sampling.sample(tiny, ids, mask, max_new_tokens=5, temperature=1.0, top_k=0,
                                                 top_p=1.0, stop_ids=[], pad_id=0,
                                                 generator=torch.Generator().manual_seed(0))
    batch = batch_of(PROMPTS, tokens.tolist())
    with torch.no_grad():
        logits = shared_prompts.completion_logits(tiny, batch.prompt_ids, batch.prompt_mask, batch.prompt_index,
                                                  batch.completion_ids, batch.completion_mask)
    teacher = logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    assert (teacher - logps).abs().max() < 1e-5


def test_under_autocast_the_cache_keeps_keys_in_bf16_with_the_same_samples_and_log_probs(tiny, monkeypatch):
    ids, mask = left_pad(PROMPTS, pad=0, device="cpu")

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return sampling.sample(tiny, ids, mask, max_new_tokens=6, temperature=1.0, top_k=0, top_p=1.0,
                                   stop_ids=[], pad_id=0, generator=torch.Generator().manual_seed(0))

    made = []
    cast = shared_prompts.keys_as_values_cache
    monkeypatch.setattr(shared_prompts, "keys_as_values_cache", lambda model: made.append(cast(model)) or made[-1])
    tokens, _, logps = run()
    assert {layer.keys.dtype for layer in made[-1].layers} == {torch.bfloat16}
    monkeypatch.setattr(shared_prompts, "keys_as_values_cache",
                        lambda model: made.append(DynamicCache(config=model.config)) or made[-1])
    plain_tokens, _, plain_logps = run()
    assert {layer.keys.dtype for layer in made[-1].layers} == {torch.float32}  # what rotary leaves
    assert torch.equal(tokens, plain_tokens) and torch.equal(logps, plain_logps)


def test_the_cache_is_freed_when_its_last_reference_goes(tiny):
    # a reference cycle would keep it, and an update's graph reached through its keys, until the next gc pass
    gc.disable()
    try:
        cache = shared_prompts.keys_as_values_cache(tiny)
        layer = weakref.ref(cache.layers[0])
        del cache
        assert layer() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_and_update_leave_no_reference_cycles_holding_tensors(dtype):
    # tensors in a cycle (a graph, the KV cache) stay resident until a garbage-collector pass
    agent = AgentConfig(model="builtin:tiny", dtype=dtype, micro_batch_size=8, generation={"max_completion_length": 4})
    trainer = AgentTrainer("a", agent, AlgorithmConfig(), seed=0)
    prompts = ["ab", "ab", "ab", "ab", "cde", "cde", "cde", "cde"]
    trainer.update(UpdateRequest(experiences=[Experience.from_completion(c, 1.0 - 2 * (i % 2)) for i, c in
                                              enumerate(trainer.generate(GenerateRequest(prompts=prompts, seed=0)).completions)]))
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a pass frees stays in gc.garbage, to look at
    try:
        result = trainer.generate(GenerateRequest(prompts=prompts, seed=1))
        trainer.update(UpdateRequest(experiences=[Experience.from_completion(c, 1.0 - 2 * (i % 2))
                                                  for i, c in enumerate(result.completions)]))
        gc.collect()
        assert not [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
