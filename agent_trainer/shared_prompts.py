"""Each distinct prompt of a batch runs through the model once, however many completions share it.

A group-relative batch holds `group_size` completions of every prompt, and the prompt is often the longer
part. Causal attention lets the prompt's keys and values be computed once per distinct prompt and then
gathered for each row that continues it: the rows' logits are those of one forward over prompt +
completion (up to rounding), and since the gather is differentiable (an `index_select`), the gradient
that reaches the prompt's activations is the sum over the rows that share it, as in the row-by-row
forward. Compute and activation memory for prompts drop by the group size. This is the shared-prefix
forward of "Prefix Grouper" (Liu et al., 2025), done with the model's own KV cache: two forward calls,
the distinct prompts (left-padded), then every row's completion attending to its prompt's cache.

`distinct_rows` finds the distinct prompts; `completion_logits` is the learner's forward;
`agent_trainer.sampling.sample` prefills the distinct prompts the same way before it decodes.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from transformers import DynamicCache


def distinct_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct rows of left-padded (B, P) `ids` / `mask` in first-seen order, and (B,) the index of each
    row's distinct row. A row is its ids and its mask: a real token whose id is the pad id is not padding."""
    keys = list(zip(map(tuple, ids.tolist()), map(tuple, mask.tolist())))
    first: dict[tuple, int] = {}  # each distinct row -> the row where it first appears
    for row, key in enumerate(keys):
        first.setdefault(key, row)
    number = {key: i for i, key in enumerate(first)}
    rows = torch.tensor(list(first.values()), device=ids.device)
    return ids.index_select(0, rows), mask.index_select(0, rows), torch.tensor([number[k] for k in keys],
                                                                                device=ids.device)


def cache_argument(model) -> str:
    """The KV-cache keyword of this model's forward: `cache` in newer transformers 5 releases, else `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, L) position ids of left-padded rows: each row's first real token is at position 0."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def keys_as_values_cache(model) -> DynamicCache:
    """The model's KV cache, storing each layer's keys in its values' dtype.

    Under autocast the rotary embedding leaves the keys in float32 (the bf16 projection times float32
    cos / sin) while the values come out of their projection in bf16; attention casts the keys to bf16
    anyway, at every step the whole cache. Stored in bf16 they give the same attention bit for bit (the
    same cast, done once), in half the memory, and faster (`benchmarks/sampling_parts.py`, "decode step,
    bf16 keys": 0.90x on SmolLM2). Without autocast both are float32: no change."""
    cache = DynamicCache(config=model.config)
    for layer in cache.layers:
        _cast_keys_to_values(layer)
    return cache


def _cast_keys_to_values(layer) -> None:
    """Wrap `layer.update`; the wrapper holds the layer weakly, so no reference cycle keeps the cache (and an
    update's graph reached through its keys) alive until a garbage-collector pass."""
    update, this = type(layer).update, weakref.ref(layer)

    def cast_update(key_states, value_states, *args, **kwargs):
        return update(this(), key_states.to(value_states.dtype), value_states, *args, **kwargs)
    layer.update = cast_update


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, index: torch.Tensor):
    """Forward of the distinct (U, P) prompts with the KV cache; returns the (B, 1, V) next-token logits of every
    row and the cache gathered to the B rows that `index` maps onto them."""
    cache_arg = cache_argument(model)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask),
                use_cache=True, logits_to_keep=1, **{cache_arg: keys_as_values_cache(model)})
    cache = out[cache_arg]
    if torch.equal(index, torch.arange(prompt_ids.size(0), device=index.device)):  # one row per prompt, in order
        return out.logits, cache
    cache.reorder_cache(index)
    return out.logits.index_select(0, index), cache


def completion_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, index: torch.Tensor,
                      completion_ids: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits predicting each of the (B, T) right-padded completion tokens, where row b continues
    the distinct left-padded prompt `index[b]` of (U, P) `prompt_ids`. With every prompt distinct (U == B)
    this is one forward over prompt + completion; otherwise the prompts run once (`prefill`) and the
    completions attend to their cache."""
    B, T = completion_ids.shape
    if prompt_ids.size(0) == B:
        prompt_ids, prompt_mask = prompt_ids.index_select(0, index), prompt_mask.index_select(0, index)
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P + T)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions(attention_mask),
                     logits_to_keep=T + 1).logits[:, :-1, :]
    first, cache = prefill(model, prompt_ids, prompt_mask, index)  # (B, 1, V): predicts completion token 0
    if T == 1:
        return first
    attention_mask = torch.cat([prompt_mask.index_select(0, index), completion_mask[:, :-1]], dim=1)  # (B, P + T - 1)
    rest = model(input_ids=completion_ids[:, :-1], attention_mask=attention_mask,
                 position_ids=positions(attention_mask)[:, prompt_ids.size(1):], use_cache=True,
                 **{cache_argument(model): cache}).logits  # (B, T - 1, V): predicts tokens 1..T-1
    return torch.cat([first, rest], dim=1)
