"""The vLLM engine for adapter agents: one engine per host serves the base once and each agent's LoRA adapter.

The host's first adapter agent that samples with vLLM builds the engine (`engine_vllm.VLLMEngine` with
`AdapterSlots`: one LoRA slot per adapter agent of the host, of the largest rank among them); each agent samples
through an `AdapterView` of it, which names the agent's adapter in every request (vLLM's multi-LoRA), so the host's
agents never sample with each other's adapter. The engine closes with the last view.

- **Weight sync.** The base never trains, so a sync moves only the agent's adapter: its tensors, under the names
  peft saves them by (`adapters.saved_names`, found once), and its `adapter_config.json` go to a fresh directory
  (in /dev/shm where the node has one with room, else the temporary directory); vLLM loads them into the agent's
  slot at once, replacing the version it held (`LoRARequest.load_inplace`), and the directory is removed. The
  prefix cache is then reset: its KV blocks were computed with the old adapter. An adapter vLLM cannot serve (a
  module it does not adapt, DoRA) fails at the view's first sync, which is at start.
- **Precision.** vLLM computes the adapter in the base's dtype (its `lora_dtype: auto`); the learner keeps it in
  float32. With a float32 base the two agree to float rounding; with a bfloat16 one the gap is the engine's
  usual one, which the update's importance weights (`rollout.tis_cap`) correct.
- **Several engines in one process.** vLLM 0.32 keeps one parallel state per process: closing a LoRA engine while
  another in the same process still serves breaks the other ("pipeline model parallel group is not
  initialized"). A run closes its engines together, at its end; code that builds trainers by hand closes them so.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from typing import Callable

import torch

from agent_trainer.engine_vllm import AdapterSlots, VLLMEngine
from agent_trainer.engines import Rollout


_FOLDERS = ("/dev/shm", None) if os.path.isdir("/dev/shm") else (None,)
"""Where a sync writes the adapter for vLLM to load: memory first, then the temporary directory (None)."""


class AdapterView:
    """Agent `adapter`'s view of its host's vLLM engine: generates and scores with its own adapter (`lora_id`),
    syncs only that adapter. `release` is called once, at `close`."""

    name = "vllm"

    def __init__(self, engine: VLLMEngine, adapter: str, lora_id: int, release: Callable[[], None],
                 weights: Callable[[], dict[str, torch.Tensor]]):
        """`weights`: the adapter's tensors as peft saves them (`get_peft_model_state_dict`'s names)."""
        self.engine, self.adapter, self.lora_id, self._release = engine, adapter, lora_id, release
        self.weights = weights

    def request(self, path: str = "", *, reload: bool = False):
        from vllm.lora.request import LoRARequest

        # a request names the adapter by its slot; the path is read only where vLLM loads it (`sync`)
        return LoRARequest(self.adapter, self.lora_id, path or f"marsi-adapter:{self.adapter}", load_inplace=reload)

    def generate(self, prompt_ids: list[list[int]], **kwargs) -> list[Rollout]:
        return self.engine.generate(prompt_ids, lora=self.request(), **kwargs)

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[list[float]]:
        return self.engine.score(prompt_ids, completion_ids, lora=self.request())

    def sleep(self) -> None:
        """Nothing to free: the config refuses `sleep_mode` for adapter agents (the base is never sent again)."""

    @torch.no_grad()
    def sync(self, model: torch.nn.Module) -> None:
        """Load the adapter `model` (the host's peft model) holds for this agent into the engine's slot."""
        folder = _written({n: t.detach().contiguous().cpu() for n, t in self.weights().items()},
                          model.peft_config[self.adapter])
        try:
            if not self.engine.llm.llm_engine.add_lora(self.request(folder, reload=True)):
                raise RuntimeError(f"the vllm engine did not load adapter {self.adapter!r}")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.engine.llm.reset_prefix_cache()  # its blocks hold keys and values of the adapter's old version

    def close(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


def _written(weights: dict[str, torch.Tensor], config) -> str:
    """A fresh directory holding an adapter as peft saves one (`weights`, `config`): in /dev/shm where it has room
    (a container's is often 64 MB), else in the temporary directory."""
    from safetensors.torch import save_file

    *first, last = _FOLDERS
    for where in [*first, last]:
        folder = None
        try:
            folder = tempfile.mkdtemp(prefix="marsi-adapter-", dir=where)
            save_file(weights, os.path.join(folder, "adapter_model.safetensors"))
            config.save_pretrained(folder)
            return folder
        except OSError:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            if where is last:
                raise


class HostEngine:
    """A host's vLLM engine for its adapter agents: built by the first view asked for, closed with the last."""

    def __init__(self, slots: AdapterSlots):
        self.slots = slots
        self.engine: VLLMEngine | None = None
        self.views: dict[str, AdapterView] = {}
        self._ids = itertools.count(1)  # vLLM's adapter ids: never reused

    def view(self, adapter: str, build: Callable[[AdapterSlots], VLLMEngine],
             weights: Callable[[], dict[str, torch.Tensor]]) -> AdapterView:
        """Agent `adapter`'s view (`weights`: its tensors, `AdapterView`); `build` makes the engine (given the
        slots) if there is none yet."""
        if adapter in self.views:
            raise ValueError(f"adapter {adapter!r} already samples with this host's vllm engine")
        if len(self.views) >= self.slots.count:
            raise ValueError(f"this host's vllm engine has {self.slots.count} adapter slots, all taken")
        if self.engine is None:
            self.engine = build(self.slots)
        view = AdapterView(self.engine, adapter, lora_id=next(self._ids), release=lambda: self._release(adapter),
                           weights=weights)
        self.views[adapter] = view
        return view

    def _release(self, adapter: str) -> None:
        view = self.views.pop(adapter)
        if self.views:  # its slot is free for another
            self.engine.llm.llm_engine.remove_lora(view.lora_id)
        elif self.engine is not None:
            self.engine.close()
            self.engine = None
