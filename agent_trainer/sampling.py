"""The distribution an agent samples from, and a decode loop that keeps only the sampled tokens' log-probs.

One definition serves generation and the update: a token's sampling distribution is
softmax(logits / temperature), cut to the `top_k` most likely tokens, then to the smallest set whose
mass reaches `top_p` (the order transformers and vLLM apply them; a tie at either edge is kept whole, so the
set does not depend on how a sort ordered equal logits), renormalised over the tokens kept.
`candidates` returns it as the candidates' logits (-inf where cut) and ids, and `token_logps` gives a
token's log-prob under it, so the behaviour log-probs stored at generation and the log-probs the
update trains describe the same distribution. With top-k on, only the K >= top_k candidates are
carried past the top-k selection, so the softmax, entropy and their gradients cost K columns, not V.
Nothing else acts on sampling: a model's own `generation_config.json` (repetition penalty, no-repeat
n-grams, min_p, typical_p, ...) is never consulted; only its end-of-sequence ids are used, to stop.

`sample` runs the decode loop itself (each distinct prompt prefilled once, `agent_trainer.shared_prompts`,
then one token at a time with the KV cache: for a Llama-architecture model on CPU, `agent_trainer.decode_step`'s
static-cache steps, which give the forward's logits bit for bit) and keeps one log-prob per sampled token: it
never holds (B, T, V) logits. It draws each token by the exponential race (argmax of p / q over the candidates, with
q = -log u ~ Exp(1) from a float64 uniform u per vocabulary token: what `torch.multinomial` does for one
sample), with the uniforms of every row of the whole request drawn from its seed: a row samples the same
tokens whichever share of the request (rows `first_row` onward) a worker of a data-parallel agent decodes.
"""

from __future__ import annotations

import torch

from agent_trainer import decode_step, shared_prompts

_CHUNK_ELEMENTS = 1 << 24  # rows of logits truncated at once: bounds the sort's temporaries to ~200 MB
_TIE_SLACK = 16  # tokens taken past the top_k-th, so that ties at its value need no second pass over V


def candidates(logits: torch.Tensor, temperature: float | torch.Tensor, top_k: int = 0,
               top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampling distribution of (..., V) `logits` as (..., K) float32 candidate logits, `logits / temperature`
    with -inf for a candidate that top-k or top-p cuts, and (..., K) the candidates' token ids.

    With `top_k` off the candidates are the whole vocabulary in order (ids None). With `top_k` on they are the
    K tokens at or above the k-th largest logit (ties at the k-th value are kept, so K >= top_k), in
    descending order: everything after this works on K columns instead of V."""
    V = logits.size(-1)
    if not 0 < top_k < V:
        values = logits.float() / temperature
        if top_p >= 1.0:
            return values, None
        with torch.no_grad():
            removed = _top_p_removed(values.detach(), top_p)  # (..., V) bool
        return values.masked_fill(removed, float("-inf")), None
    with torch.no_grad():
        # top_k + _TIE_SLACK in one pass: ties at the k-th value (common in bf16 logits) usually fit in the slack
        top, ids = logits.detach().topk(min(top_k + _TIE_SLACK, V), dim=-1)  # descending
        kth = top[..., top_k - 1:top_k]  # (..., 1)
        if top.size(-1) < V and bool((top[..., -1] >= kth[..., 0]).any()):  # the ties may run past the slack
            width = int((logits.detach() >= kth).sum(-1).max())
            ids = logits.detach().topk(width, dim=-1).indices  # (..., K), descending
        else:
            ids = ids[..., :int((top >= kth).sum(-1).max())]  # (..., K): the most candidates any row keeps
    raw = logits.gather(-1, ids)  # (..., K), with the gradient
    values = (raw.float() / temperature).masked_fill(raw < kth, float("-inf"))
    if top_p < 1.0:
        with torch.no_grad():
            removed = _mass_above(values.detach()) >= top_p
        values = values.masked_fill(removed, float("-inf"))
    return values, ids


def _top_p_removed(values: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., V) bool: the tokens cut by top-p, those whose strictly larger tokens already hold top_p of the mass."""
    shape, V = values.shape, values.size(-1)
    flat = values.reshape(-1, V)
    removed = torch.zeros_like(flat, dtype=torch.bool)
    rows = max(1, _CHUNK_ELEMENTS // V)
    for i in range(0, flat.size(0), rows):
        ordered, order = torch.sort(flat[i:i + rows], dim=-1, descending=True)
        removed[i:i + rows].scatter_(-1, order, _mass_above(ordered) >= top_p)
    return removed.reshape(shape)


def _mass_above(ordered: torch.Tensor) -> torch.Tensor:
    """(..., N) for (..., N) logits in descending order: the probability mass of the tokens whose logit is strictly
    larger. Tied tokens get the same mass, so top-p keeps or cuts a tie whole, whatever order a sort left it in:
    generation and the update, which see the same logits in batches of other shapes, cut the same tokens."""
    probs = ordered.softmax(-1)
    before = probs.cumsum(-1) - probs  # the mass ranked above each position
    new_value = torch.ones_like(ordered, dtype=torch.bool)
    new_value[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    positions = torch.arange(ordered.size(-1), device=ordered.device).expand_as(ordered)
    first_of_tie = torch.where(new_value, positions, 0).cummax(-1).values
    return before.gather(-1, first_of_tie)


def token_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | torch.Tensor, top_k: int = 0,
                top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(...) log-prob of each of the (...) `tokens` under the sampling distribution of the (..., V) `logits`, and
    the (..., K') candidate logits it is normalised over (for the entropy).

    The token itself is always a candidate, whatever its rank: the update passes the sampled tokens, so a
    token sampled from the set is never given log-prob -inf because of numerics that differ slightly from
    generation's (or, with num_iterations > 1, because the policy moved)."""
    values, ids = candidates(logits, temperature, top_k, top_p)
    index = tokens.unsqueeze(-1)  # (..., 1)
    if ids is None and top_p >= 1.0:
        # nothing was cut: the token's tempered logit is one of the values (one backward path through V, not two)
        return values.gather(-1, index).squeeze(-1) - values.logsumexp(-1), values
    picked = logits.gather(-1, index).float() / temperature  # (..., 1) the token's tempered logit
    if ids is None:  # top-p only: back in if top-p cut it
        values = values.scatter(-1, index, picked)
    else:
        is_token = ids == index  # (..., K)
        values = torch.where(is_token, picked, values)  # back in if top-p cut it
        outside = picked.masked_fill(is_token.any(-1, keepdim=True), float("-inf"))  # ranked below the candidates
        values = torch.cat([values, outside], dim=-1)  # (..., K + 1)
    return picked.squeeze(-1) - values.logsumexp(-1), values


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
    cache_arg = shared_prompts.cache_argument(model)
    stop = torch.tensor(stop_ids, device=device)
    distinct_ids, distinct_mask, index = shared_prompts.distinct_rows(prompt_ids, prompt_mask)
    logits, cache = shared_prompts.prefill(model, distinct_ids, distinct_mask, index)  # (B, 1, V): each prompt once
    decoder = None
    if max_new_tokens > 1 and decode_step.supports(model):  # the prompts' keys and values move to its static cache
        decoder, cache = decode_step.StaticDecoder(model, cache, prompt_mask, max_new_tokens - 1), None
    attention_mask = prompt_mask
    position_ids = shared_prompts.positions(prompt_mask)[:, -1:]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    uniform = torch.empty(total_rows, logits.size(-1), dtype=torch.float64, device=device)  # refilled at each step
    tokens, logps = [], []
    for t in range(max_new_tokens):
        if temperature == 0:  # greedy: a point mass on the most likely token, whose log-prob is 0
            token = logits[:, -1, :].argmax(-1).masked_fill(done, pad_id)  # (B,)
            token_logp = torch.zeros(B, device=device)
        else:
            values, ids = candidates(logits[:, -1, :], temperature, top_k, top_p)  # (B, K)
            logp = values.log_softmax(-1)  # (B, K)
            share = uniform.uniform_(generator=generator)[first_row:first_row + B]  # (B, V): one per token
            log_u = share.log_() if ids is None else share.gather(1, ids).log_()  # (B, K): -Exp(1) noise
            # the exponential race argmax(p / -log u), as argmin(p / log u): the same quotients negated exactly
            pick = (logp.exp() / log_u).argmin(-1)  # (B,)
            token = (pick if ids is None else ids.gather(1, pick.unsqueeze(1)).squeeze(1)).masked_fill(done, pad_id)
            token_logp = logp.gather(1, pick.unsqueeze(1)).squeeze(1).masked_fill(done, 0.0)  # (B,)
        tokens.append(token)
        logps.append(token_logp)
        stopped = ~done & torch.isin(token, stop)
        lengths = torch.where(stopped, t + 1, lengths)
        done |= stopped
        if bool(done.all()) or t + 1 == max_new_tokens:
            break
        position_ids = position_ids + 1
        if decoder is not None:
            logits = decoder(token, position_ids)
            continue
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
        out = model(input_ids=token.unsqueeze(1), attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, logits_to_keep=1, **{cache_arg: cache})
        logits, cache = out.logits, out[cache_arg]
    return torch.stack(tokens, 1), lengths, torch.stack(logps, 1)
