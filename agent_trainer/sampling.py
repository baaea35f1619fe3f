"""The distribution an agent samples from, and a decode loop that keeps only the sampled tokens' log-probs.

One definition serves generation and the update: a token's sampling distribution is
softmax(logits / temperature), cut to the `top_k` most likely tokens, then to the smallest set whose
mass reaches `top_p` (the order transformers and vLLM apply them), renormalised over the tokens kept.
`sampling_logits` returns it as logits with -inf outside the kept set, so the behaviour log-probs
stored at generation and the log-probs the update trains describe the same distribution. Nothing
else acts on sampling: a model's own `generation_config.json` (repetition penalty, no-repeat n-grams,
min_p, typical_p, ...) is never consulted; only its end-of-sequence ids are used, to stop.

`sample` runs the decode loop itself (prefill, then one token at a time with the KV cache) and keeps
one log-prob per sampled token: it never holds (B, T, V) logits. It draws each token by the exponential
race (argmax of p / q with q ~ Exp(1), what `torch.multinomial` does for one sample), with the noise of
every row of the whole request drawn from its seed: a row samples the same tokens whichever share of the
request (rows `first_row` onward) a worker of a data-parallel agent decodes.
"""

from __future__ import annotations

import inspect

import torch

_CHUNK_ELEMENTS = 1 << 24  # rows of logits truncated at once: bounds the sort's temporaries to ~200 MB


def sampling_logits(logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int = 0, top_p: float = 1.0,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """(..., V) `logits / temperature` with every token outside the top-k / top-p set at -inf.

    `keep` (...) holds token ids that stay in the set whatever their rank: the update passes the sampled
    tokens, so a token sampled from the set is never given log-prob -inf because of numerics that differ
    slightly from generation's (or, with num_iterations > 1, because the policy moved)."""
    logits = logits / temperature
    if top_k <= 0 and top_p >= 1.0:
        return logits
    with torch.no_grad():
        removed = truncated_tokens(logits.detach(), top_k, top_p)  # (..., V) bool
        if keep is not None:
            removed.scatter_(-1, keep.unsqueeze(-1), False)
    return logits.masked_fill(removed, float("-inf"))


def truncated_tokens(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(..., V) bool: the tokens top-k and then top-p remove (ties at the k-th value are kept)."""
    shape, V = logits.shape, logits.size(-1)
    flat = logits.reshape(-1, V)
    removed = torch.zeros_like(flat, dtype=torch.bool)
    rows = max(1, _CHUNK_ELEMENTS // V)
    for i in range(0, flat.size(0), rows):
        chunk, out = flat[i:i + rows], removed[i:i + rows]
        if 0 < top_k < V:
            kth = torch.topk(chunk, top_k, dim=-1).values[:, -1:]  # (N, 1)
            out |= chunk < kth
        if top_p < 1.0:
            ordered, order = torch.sort(chunk.masked_fill(out, float("-inf")), dim=-1, descending=True)
            probs = ordered.softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
            out |= torch.zeros_like(out).scatter_(-1, order, mass_before >= top_p)
    return removed.reshape(shape)


def stop_token_ids(tokenizer, model) -> list[int]:
    """End-of-sequence ids: the tokenizer's, and any the model's generation config lists (e.g. Qwen's two)."""
    ids = {tokenizer.eos_token_id}
    config_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(config_ids if isinstance(config_ids, (list, tuple)) else [config_ids])
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def sample(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
           temperature: float, top_k: int, top_p: float, stop_ids: list[int], pad_id: int,
           generator: torch.Generator, first_row: int = 0,
           total_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample from left-padded prompts until each row samples a stop id or has `max_new_tokens`.

    The prompts are rows `first_row` to `first_row + B` of a request of `total_rows` (default B) rows, all
    sampled from `generator`: each decode step draws the noise of all `total_rows` rows and uses this
    share's. `temperature` 0 decodes greedily. Returns (B, T) completion ids (pad after a row's stop), (B,) lengths
    (the stop id included), and (B, T) log-probs of the sampled tokens under the sampling distribution
    (0 after a row's stop, and 0 throughout when greedy)."""
    B, device = prompt_ids.size(0), prompt_ids.device
    total_rows = B if total_rows is None else total_rows
    cache_arg = _cache_argument(model)
    stop = torch.tensor(stop_ids, device=device)
    attention_mask = prompt_mask
    position_ids = (prompt_mask.cumsum(1) - 1).clamp(min=0)  # left padding: every row starts at position 0
    input_ids, cache = prompt_ids, None
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    tokens, logps = [], []
    for t in range(max_new_tokens):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        cache = out[cache_arg]
        if temperature == 0:  # greedy: a point mass on the most likely token, whose log-prob is 0
            token = out.logits[:, -1, :].argmax(-1).masked_fill(done, pad_id)  # (B,)
            token_logp = torch.zeros(B, device=device)
        else:
            logp = sampling_logits(out.logits[:, -1, :].float(), temperature, top_k, top_p).log_softmax(-1)  # (B, V)
            noise = torch.empty(total_rows, logp.size(1), device=device).exponential_(generator=generator)  # (N, V)
            race = logp.exp() / noise[first_row:first_row + B]  # (B, V)
            token = race.argmax(-1).masked_fill(done, pad_id)  # (B,)
            token_logp = logp.gather(1, token.unsqueeze(1)).squeeze(1).masked_fill(done, 0.0)  # (B,)
        tokens.append(token)
        logps.append(token_logp)
        stopped = ~done & torch.isin(token, stop)
        lengths = torch.where(stopped, t + 1, lengths)
        done |= stopped
        if bool(done.all()):
            break
        input_ids = token.unsqueeze(1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
        position_ids = position_ids[:, -1:] + 1
    return torch.stack(tokens, 1), lengths, torch.stack(logps, 1)


def _cache_argument(model) -> str:
    """The KV-cache keyword of this model's forward: `cache` in newer transformers 5 releases, else `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
