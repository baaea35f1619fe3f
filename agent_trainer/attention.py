"""SDPA, with the short attentions of RL on CPU computed without SDPA's per-call costs.

Two costs of transformers' SDPA path dominate a CPU trainer's attention at RL's lengths:

- The update: torch's CPU flash-attention backward spends most of its time on per-call work at short
  lengths (on SmolLM2, 8 completions of 32 tokens after 2 shared prompts, bf16 autocast, a torch-profiler
  run gave 7.6 ms per layer call, 12% of an update). Written out as softmax(q k^T * scale) v, an
  attention of that size costs a fraction of it, with the same result to rounding. The written-out form keeps the (B, H, L, S)
  scores, so it serves only attentions of at most `MATH_ELEMENTS` scores.
- A decode step (one query): with a padding mask, transformers copies the keys and values of every
  grouped-query head (`repeat_kv`) before SDPA, at every layer and token. SDPA's own grouped-query mode
  (`enable_gqa`) gives the same output bit for bit without the copies.

Longer attentions, and every attention on a GPU, go to transformers' SDPA as before. `install()` registers
it with transformers (importing this module does not); `use(model)` installs it and switches a model loaded
with SDPA (transformers' default) to it; the masks are SDPA's.
`benchmarks/sampling_parts.py` times both beside SDPA ("update pass, bf16", "decode attention").
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "sdpa_short_math"
MATH_ELEMENTS = 1 << 20  # scores per layer call written out (4 MB in fp32); beyond it, SDPA
_SDPA_ONLY = ("position_bias", "softcap", "s_aux")  # arguments some models pass: they go to SDPA as before


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: (B, H, L, D) query, (B, H_kv, S, D) key and value, SDPA's mask (bool,
    True where a query may attend, or None for plain causal); returns the (B, L, H, D) output."""
    B, H, L, D = query.shape
    S = key.size(2)
    if (query.device.type != "cpu" or dropout or any(kwargs.get(k) is not None for k in _SDPA_ONLY)
            or (attention_mask is not None and attention_mask.dtype != torch.bool)
            or (L > 1 and B * H * L * S > MATH_ELEMENTS)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if L == 1:  # a decode step: SDPA over the grouped heads, no copies
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is None and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        # SDPA's is_causal: query i sees keys 0..i (transformers cuts longer keys to L first)
        key, value = key[:, :, :L], value[:, :, :L]
        attention_mask = torch.ones(1, 1, L, L, dtype=torch.bool, device=query.device).tril()
    H_kv = key.size(1)
    grouped = query.reshape(B, H_kv, H // H_kv * L, D)  # the query heads of each key head, one after another
    scale = scaling if scaling is not None else D ** -0.5
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float().mul(scale).view(B, H_kv, H // H_kv, L, -1)
    if attention_mask is not None:  # the float32 minimum, not -inf: a row with nothing to attend stays finite
        scores = scores.masked_fill(~attention_mask.unsqueeze(2), torch.finfo(torch.float32).min)
    probs = scores.softmax(-1).to(value.dtype).view(B, H_kv, H // H_kv * L, -1)
    return torch.matmul(probs, value).view(B, H, L, value.size(-1)).transpose(1, 2).contiguous(), None


def install() -> None:
    """Register this attention and its mask (SDPA's) with transformers under `NAME`; importing this module
    registers nothing. Registering again replaces the entry with the same functions."""
    AttentionInterface.register(NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use(model: torch.nn.Module) -> None:
    """Compute `model`'s attention here instead of SDPA, where it uses SDPA (an explicit eager or flash choice
    stays); installs it first."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        install()
        model.set_attn_implementation(NAME)
