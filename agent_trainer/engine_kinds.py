"""Which rollout engine each `agents.NAME.rollout.engine` name makes (the interface: `engines.RolloutEngine`).

A new engine is a file of its own holding a class with `RolloutEngine`'s methods, one branch here, and its
name in `protocols.config.RolloutConfig.engine`."""

from __future__ import annotations

from typing import Callable, ContextManager

import torch

from agent_trainer.engines import HFEngine, RolloutEngine
from protocols.config import AgentConfig


def make_engine(agent: AgentConfig, model: torch.nn.Module, *, model_path: str, tokenizer_path: str,
                stop_ids: list[int], pad_id: int, device: torch.device, seed: int,
                autocast: Callable[[], ContextManager], kv_cache_sequences: int | None = None,
                adapters=None) -> RolloutEngine:
    """The engine `agent.rollout.engine` names (the hf engine where that engine is placed apart), sampling from
    `model` (whose weights came from `model_path`); `kv_cache_sequences`: a vLLM engine's CPU KV-cache size, as the
    run's plan sizes it (`RunPlan.engine_cache_sizes`); `adapters`: a vLLM engine's LoRA slots
    (`engine_vllm.AdapterSlots`), for adapter agents."""
    gen = agent.generation
    if agent.rollout.engine == "hf" or agent.rollout.placement == "separate":
        # a learner whose engine is an actor of its own samples nothing itself: the hf engine over its own model
        # costs no memory, and serves its checks (`Agent.score` with `engine=True`)
        return HFEngine(model, top_k=gen.top_k, top_p=gen.top_p, stop_ids=stop_ids, pad_id=pad_id, device=device,
                        autocast=autocast)
    from agent_trainer.engine_vllm import VLLMEngine  # imports vLLM: only for an agent that samples with it

    return VLLMEngine(model_path=model_path, tokenizer_path=tokenizer_path, generation=gen,
                      settings=agent.rollout.vllm, dtype=agent.rollout.vllm.dtype or agent.dtype,
                      stop_ids=stop_ids, device=device, seed=seed, kv_cache_sequences=kv_cache_sequences,
                      adapters=adapters)
