"""An agent's parameter counts from its model's config alone, for the memory plan's estimates."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from agent_trainer.adapters import lora_config
from agent_trainer.models import model_config


def parameter_counts(agent) -> tuple[int, int]:
    """(parameters of the agent's model, those it trains: all of them, or its LoRA adapter's), counted on the
    meta device: no weights are loaded."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(agent.model))
    total = sum(p.numel() for p in model.parameters())
    if agent.adapter is None:
        return total, total
    from peft import get_peft_model

    with torch.device("meta"):
        adapted = get_peft_model(model, lora_config(agent))
    return total, sum(p.numel() for p in adapted.parameters() if p.requires_grad)
