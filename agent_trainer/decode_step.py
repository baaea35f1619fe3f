"""The decode steps of a Llama-architecture model on CPU, written over the model's own weights with a static KV cache.

A decode step runs one token per row through the model. At RL's batch sizes on a CPU thread, transformers'
forward spends much of such a step outside the matrix products: a module call per projection, norm and
activation, a causal mask built at every step, the KV cache grown by concatenation at every layer.
`StaticDecoder` does the same arithmetic with the same torch calls (so the logits are transformers', bit for
bit, which `tests/test_decode_step.py` checks), but:

- the keys and values live in one buffer per layer sized for the prompt and every new token (a static cache),
  written in place: no concatenation, and attention reads a view of the buffer up to the current token;
- the padding mask is built once and sliced;
- the weights of each layer are looked up once per `sample` call, not through module attributes per step.

It serves `LlamaForCausalLM` with every projection a plain `nn.Linear` (SmolLM2, Llama, the `builtin:tiny`
model; a LoRA-wrapped model has other modules there) and attention through SDPA (`agent_trainer.attention`'s
or transformers'), on CPU; `sampling.sample` falls back to the model's forward for any other model.
`benchmarks/decode_floor.py` times a whole `generate` against this machine's floor.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from agent_trainer import attention

_ATTENTION = (attention.NAME, "sdpa")  # the implementations whose decode attention is SDPA over grouped heads
_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")


def supports(model: torch.nn.Module) -> bool:
    """Whether `StaticDecoder` computes `model`'s decode steps exactly as its forward does."""
    config = getattr(model, "config", None)
    if type(model).__name__ != "LlamaForCausalLM" or getattr(config, "_attn_implementation", None) not in _ATTENTION:
        return False
    if model.lm_head.weight.device.type != "cpu" or type(model.lm_head) is not torch.nn.Linear:
        return False
    return all(type(layer.get_submodule(name)) is torch.nn.Linear
               for layer in model.model.layers for name in _PROJECTIONS)


class StaticDecoder:
    """Decode steps after a prefill: `decoder(token, position_ids)` gives the (B, 1, V) logits after each row's
    next token, with the prefill's keys and values and every earlier step's in a static cache."""

    def __init__(self, model: torch.nn.Module, cache, prompt_mask: torch.Tensor, max_new_tokens: int):
        """`cache`: the prefill's transformers cache (B rows of P prompt positions); `prompt_mask`: the (B, P)
        left-padded prompts' mask; room is made for `max_new_tokens` more positions."""
        config = model.config
        self.embed, self.rotary, self.norm = model.model.embed_tokens, model.model.rotary_emb, model.model.norm
        self.head = model.lm_head
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = model.model.layers[0].self_attn.scaling
        self.layers = []
        B, P = prompt_mask.shape
        for i, layer in enumerate(model.model.layers):
            keys, values = cache.layers[i].keys, cache.layers[i].values  # (B, H_kv, P, D)
            key_buffer = values.new_empty(B, self.kv_heads, P + max_new_tokens, self.head_dim)
            value_buffer = torch.empty_like(key_buffer)
            key_buffer[:, :, :P] = keys
            value_buffer[:, :, :P] = values
            mlp = layer.mlp
            act = F.silu if config.hidden_act == "silu" else mlp.act_fn
            projections = [layer.get_submodule(name) for name in _PROJECTIONS]
            self.layers.append((layer.input_layernorm, layer.post_attention_layernorm,
                                *((m.weight, m.bias) for m in projections), act, key_buffer, value_buffer))
        self.length = P  # positions held in the cache
        # transformers gives SDPA no mask when no row is padded, else the padding (True where a key may be seen)
        self.mask = None if bool(prompt_mask.all()) else torch.cat(
            [prompt_mask.bool(), prompt_mask.new_ones(B, max_new_tokens, dtype=torch.bool)], 1)[:, None, None, :]

    def __call__(self, token: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """(B,) tokens at (B, 1) positions: returns the (B, 1, V) logits of the next token."""
        B, at = token.size(0), self.length
        seen = at + 1
        self.length = seen
        hidden = self.embed(token.unsqueeze(1))  # (B, 1, d)
        cos, sin = self.rotary(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, 1, D)
        mask = None if self.mask is None else self.mask[..., :seen]
        for norm_in, norm_post, q_proj, k_proj, v_proj, o_proj, gate, up, down, act, keys, values in self.layers:
            residual = hidden
            x = rms_norm(hidden, norm_in)
            query = linear(x, q_proj).view(B, 1, self.heads, self.head_dim).transpose(1, 2)
            key = linear(x, k_proj).view(B, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            value = linear(x, v_proj).view(B, 1, self.kv_heads, self.head_dim).transpose(1, 2)
            query = query * cos + rotate_half(query) * sin
            key = key * cos + rotate_half(key) * sin
            keys[:, :, at:seen] = key  # cast to the values' dtype, as `shared_prompts.keys_as_values_cache` stores
            values[:, :, at:seen] = value
            out = F.scaled_dot_product_attention(query, keys[:, :, :seen], values[:, :, :seen], attn_mask=mask,
                                                 scale=self.scaling, enable_gqa=True)
            hidden = residual + linear(out.transpose(1, 2).contiguous().reshape(B, 1, -1).contiguous(), o_proj)
            residual = hidden
            x = rms_norm(hidden, norm_post)
            hidden = residual + linear(act(linear(x, gate)) * linear(x, up), down)
        return linear(rms_norm(hidden, self.norm), (self.head.weight, self.head.bias))


def linear(x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    return F.linear(x, *weight_bias)


def rms_norm(hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
