"""The optimizer step every trainer takes (an agent's `AgentTrainer`, a critic's `CriticTrainer`): skipped when
the loss or the gradient is not finite, the gradient clipped by its global norm, then stepped, and counted."""

from __future__ import annotations

import math
from typing import Iterable

import torch


class GuardedSteps:
    """The steps of one update: each one's gradient norm (NaN for a skipped step) and how many were skipped."""

    def __init__(self) -> None:
        self.grad_norms: list[float] = []
        self.skipped = 0

    def step(self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.nn.Parameter], *,
             max_grad_norm: float | None, finite: bool, scaler: torch.amp.GradScaler | None = None) -> None:
        """One step on the accumulated gradients unless `finite` is False (a non-finite loss was met) or their norm
        is not finite; `scaler`: a loss scaler, which unscales the gradients first and is updated either way (it
        lowers its scale after a non-finite gradient)."""
        grad_norm = math.nan
        if finite:
            if scaler is not None:
                scaler.unscale_(optimizer)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm or math.inf))
            finite = math.isfinite(grad_norm)
            if finite:
                if scaler is not None:
                    scaler.step(optimizer)
                else:
                    optimizer.step()
            if scaler is not None:
                scaler.update()
        self.skipped += not finite
        self.grad_norms.append(grad_norm)

    @property
    def mean_grad_norm(self) -> float:
        """The steps' mean gradient norm (NaN if any was skipped)."""
        return sum(self.grad_norms) / len(self.grad_norms)
