"""Adapter agents: a LoRA adapter (through `peft`) on a frozen base model that the agents of one host share.

An agent with `agents.NAME.adapter` trains only its adapter. The agents of one host (`agents.NAME.host`) hold
one `SharedBase`: one copy of the base weights (stored in `agents.NAME.dtype`: nothing of it is trained) in a
`peft` model with one named adapter per agent. Each agent keeps its own adapter weights (float32), optimizer,
learning-rate state, update count and RNG state; its calls run one at a time inside
`AdapterTrainer.selected`, which makes its adapter the active one (the only one in the forward pass, the
only one with gradients) and swaps in its RNG state.

- **KL reference.** `BaseOnly`: the shared base with the adapters switched off for the forward pass; no copy.
- **Checkpoints.** `AGENT_DIR/adapter/` (`adapter_model.safetensors`, `adapter_config.json`: the layout
  `peft` writes, which `PeftModel.from_pretrained(base, AGENT_DIR / "adapter")` loads) and
  `AGENT_DIR/trainer_state.pt` (`AgentTrainer.save_training_state`): never the base. A frozen
  adapter agent that has not loaded a checkpoint writes only where its weights come from (`source.json`).
- **Dropout.** `adapter.dropout` acts in updates only: sampling and the log-probs it records never drop.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import torch

from agent_trainer import rng
from agent_trainer.engine_kinds import make_engine
from agent_trainer.models import SOURCE_MARKER, load_model, resolve_model_path, source_fingerprint
from agent_trainer.trainer import AgentTrainer, check_same_source, refuse_nonfinite, weights_digest
from protocols.config import AgentConfig, AlgorithmConfig
from protocols.messages import CheckpointInfo, WeightDigests

ADAPTER_DIR = "adapter"
"""An adapter agent's checkpoint holds its adapter here, in peft's layout."""


def adapter_name(agent: str) -> str:
    """The name of agent `agent`'s adapter in the shared peft model (peft refuses names inside `lora_`)."""
    return f"agent_{agent}"


class SharedBase:
    """One base model and tokenizer for the adapter agents of one host; each agent attaches its own adapter."""

    def __init__(self, engine_slots=None):
        """`engine_slots`: the LoRA slots (`engine_vllm.AdapterSlots`) of the host's vLLM engine, for its agents
        that sample with one (colocated); None: one, of the first such agent's rank."""
        self.engine_slots = engine_slots
        self.vllm = None  # the host's vLLM engine (`engine_vllm_adapters.HostEngine`), once an agent asks for it
        self.model = None  # a peft model once the first agent attaches
        self.tokenizer = None
        self.source: tuple[str, str | None, str] | None = None  # (model, tokenizer, dtype) every agent must name
        self.rng_states: dict[str, dict[str, Any]] = {}
        self.active: str | None = None  # the adapter the last `AdapterTrainer.selected` made active
        self._parts: dict[str, tuple[dict[str, torch.nn.Parameter], list[torch.nn.Module]]] = {}

    def parts(self, agent: str) -> tuple[dict[str, torch.nn.Parameter], list[torch.nn.Module]]:
        """Agent `agent`'s adapter parameters and its dropout modules, found once by a walk of the whole model
        (not at every call of the agent, nor twice per weight transfer); an `attach` forgets them."""
        if agent not in self._parts:
            name = adapter_name(agent)
            dropouts = [m.lora_dropout[name] for m in self.model.modules()
                        if isinstance(getattr(m, "lora_dropout", None), torch.nn.ModuleDict) and name in m.lora_dropout]
            self._parts[agent] = own_parameters(self.model, agent), dropouts
        return self._parts[agent]

    def attach(self, name: str, agent: AgentConfig, *, device: torch.device, trainable: bool):
        """Add agent `name`'s adapter (fresh, or loaded from `adapter.path`); the shared peft model and tokenizer.
        The base is loaded by the first agent; its weights never require gradients."""
        from peft import PeftModel, get_peft_model

        source = (agent.model, agent.tokenizer, agent.dtype)
        if self.source is not None and source != self.source:
            raise ValueError(f"agent {name!r}: model {source} differs from the host's base {self.source}; agents "
                             "of one host share one base model")
        settings, name = agent.adapter, adapter_name(name)
        if self.model is None:
            base, self.tokenizer = load_model(agent.model, tokenizer=agent.tokenizer, device=device, dtype=agent.dtype)
            base.requires_grad_(False)
            self.source = source
            if settings.path is not None:
                self.model = PeftModel.from_pretrained(base, settings.path, adapter_name=name, is_trainable=trainable)
            else:
                self.model = get_peft_model(base, lora_config(agent), adapter_name=name)
        elif settings.path is not None:
            self.model.load_adapter(settings.path, adapter_name=name, is_trainable=trainable)
        else:
            self.model.add_adapter(name, lora_config(agent))
        self.model.to(device)
        for p in self.model.parameters():  # each call makes its agent's adapter trainable (`selected`)
            p.requires_grad_(False)
        self.active, self._parts = None, {}  # peft may have switched adapters, and the model has new parameters
        self.rng_states[name] = rng.capture()  # the agent's own stream starts where its construction left it
        return self.model, self.tokenizer


def adapter_rank(agent: AgentConfig) -> int:
    """The rank of agent `agent`'s adapter: its `adapter.rank`, or the largest in the saved adapter's
    adapter_config.json (`r`, and any `rank_pattern`) where it starts from `adapter.path`."""
    settings = agent.adapter
    if settings.path is None:
        return settings.rank
    try:
        saved = json.loads((Path(settings.path) / "adapter_config.json").read_text())
    except (OSError, ValueError):  # attaching it says what is wrong with it
        return settings.rank
    # peft's default rank where the file gives none
    return max([int(saved.get("r", 8)), *map(int, (saved.get("rank_pattern") or {}).values())])


def adapter_targets(agent: AgentConfig) -> tuple[str, ...]:
    """The modules agent `agent`'s adapter adapts, as its settings (or its saved adapter_config.json) name them."""
    targets = agent.adapter.target_modules
    if agent.adapter.path is not None:
        try:
            targets = json.loads((Path(agent.adapter.path) / "adapter_config.json").read_text())["target_modules"]
        except (OSError, ValueError, KeyError):  # attaching it says what is wrong with it
            return ("all-linear",)
    return (targets,) if isinstance(targets, str) else tuple(targets)


def engine_slots(agents: list[AgentConfig]):
    """The LoRA slots (`engine_vllm.AdapterSlots`) of a vLLM engine serving the adapters of `agents`: one each, of
    their largest rank, on every module any of them adapts."""
    from agent_trainer.engine_vllm import AdapterSlots

    return AdapterSlots(rank=max(adapter_rank(a) for a in agents), count=len(agents),
                        targets=tuple(sorted({t for a in agents for t in adapter_targets(a)})))


def resolved_targets(targets: tuple[str, ...], model) -> tuple[str, ...]:
    """`targets` with peft's `all-linear` made the names it stands for in `model` (a peft model): every linear
    layer but the output head."""
    if "all-linear" not in targets:
        return tuple(sorted(set(targets)))
    base = model.get_base_model()
    head = base.get_output_embeddings()
    head = getattr(head, "base_layer", head)  # an adapter on the head wraps it
    linear = {name.removesuffix(".base_layer").rsplit(".", 1)[-1] for name, m in base.named_modules()
              if isinstance(m, torch.nn.Linear) and m is not head and ".lora_" not in name}
    return tuple(sorted(linear | set(targets) - {"all-linear"}))


def lora_config(agent: AgentConfig):
    from peft import LoraConfig

    a = agent.adapter
    return LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=a.dropout, bias="none", task_type="CAUSAL_LM",
                      target_modules=a.target_modules if isinstance(a.target_modules, str) else list(a.target_modules))


class BaseOnly:
    """The shared base with every adapter off: an adapter agent's KL reference, without a copy of the weights."""

    def __init__(self, model):
        self.model, self.config = model, model.config

    def forward(self, **kwargs):
        with self.model.disable_adapter():
            return self.model(**kwargs)

    __call__ = forward


# ---------------------------------------------------------------------------------- the host kind
class AdapterTrainer(AgentTrainer):
    """An adapter agent: a full-model agent's learner whose policy is its adapter on the host's shared base.
    `base`: the host's `SharedBase` (None: a base of its own)."""

    def __init__(self, name: str, agent: AgentConfig, algorithm: AlgorithmConfig, *, base: SharedBase | None = None,
                 **kwargs):
        self.shared = base if base is not None else SharedBase()
        super().__init__(name, agent, algorithm, **kwargs)

    def _load_policy(self):
        """The shared peft model with this agent's adapter attached; the base stays frozen in agent.dtype, the
        adapter trains in float32."""
        return self.shared.attach(self.name, self.agent, device=self.device, trainable=self.trainable)

    def _reference_model(self):
        return BaseOnly(self.model)  # the shared base, adapters off: no copy

    def _make_engine(self, agent: AgentConfig, **kwargs):
        """A colocated vLLM engine: this agent's view of its host's one engine (`engine_vllm_adapters`), which
        starts with the base alone and so takes the agent's adapter at once; any other engine as a full agent's."""
        if agent.rollout.engine != "vllm" or agent.rollout.placement == "separate":
            return super()._make_engine(agent, **kwargs)
        from agent_trainer.engine_vllm_adapters import HostEngine

        shared = self.shared
        if shared.vllm is None:
            slots = shared.engine_slots or engine_slots([agent])
            shared.vllm = HostEngine(replace(slots, targets=resolved_targets(slots.targets, self.model)))
        saved = saved_names(shared.parts(self.name)[0], self.name)
        view = shared.vllm.view(adapter_name(self.name),
                                lambda slots: make_engine(agent, self.model, adapters=slots, **kwargs),
                                weights=lambda: {saved[n]: p for n, p in shared.parts(self.name)[0].items()})
        try:
            view.sync(self.model)
        except BaseException:
            view.close()
            raise
        return view

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        return list(own_parameters(self.model, self.name).values())

    @contextlib.contextmanager
    def selected(self, *, updating: bool = False) -> Iterator[None]:
        """Run one call of this agent: its adapter active (the others out of the forward pass and without
        gradients), its RNG state in the process, its adapter's dropout on during an update (`updating`)."""
        shared, name = self.shared, adapter_name(self.name)
        own, dropouts = shared.parts(self.name)
        if shared.active != name:  # peft's switch walks every module: only when another agent's adapter is active
            self.model.set_adapter(name)
            shared.active = name
        for p in own.values():
            p.requires_grad_(self.trainable)
        states = shared.rng_states
        rng.restore(states[name])
        if updating:
            for d in dropouts:
                d.train()
        try:
            yield
        finally:
            for d in dropouts:
                d.eval()
            states[name] = rng.capture()

    def published_weights(self) -> dict[str, torch.Tensor]:
        """Its adapter's weights, for its rollout engine of its own, which holds the same base: the live tensors, as
        `AgentTrainer.published_weights`."""
        return {n: p.detach() for n, p in self.shared.parts(self.name)[0].items()}

    def take_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """An engine process: sample with this adapter, the learner's at policy `version`, on the base it holds."""
        own = self.shared.parts(self.name)[0]
        if set(weights) != set(own):
            raise ValueError(f"agent {self.name!r}: the published adapter has {len(weights)} tensors, the engine's "
                             f"{len(own)}; learner and engine must attach the same adapter")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(weights[n])
        self.engine.sync(self.model)
        self.policy_version = version

    def parameters_digest(self) -> str:
        """SHA-256 of the weights this agent computes with: the base and its own adapter."""
        return weights_digest({n: p for n, p in self.model.named_parameters()
                               if _owner(n) in (None, adapter_name(self.name))})

    def weight_digests(self) -> WeightDigests:
        base = {n: p for n, p in self.model.named_parameters() if _owner(n) is None}
        return WeightDigests(base=weights_digest(base), adapter=weights_digest(own_parameters(self.model, self.name)))

    def save(self, path: str | Path) -> CheckpointInfo:
        """The agent's adapter (peft's layout, under `path/adapter`) and training state; never the base."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        if not self.trainable and not self.from_checkpoint:
            (path / SOURCE_MARKER).write_text(json.dumps(_frozen_source(self.agent)))
            return self._checkpoint_info(path)
        weights = get_peft_model_state_dict(self.model, adapter_name=adapter_name(self.name),
                                            save_embedding_layers=False)  # the base is never trained: never saved
        refuse_nonfinite(self.name, "adapter", weights)
        out = path / ADAPTER_DIR
        out.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().contiguous().cpu() for n, p in weights.items()}, out / "adapter_model.safetensors",
                  metadata={"format": "pt"})
        config = copy.deepcopy(self.model.peft_config[adapter_name(self.name)])
        config.base_model_name_or_path = resolve_model_path(self.agent.model)
        config.inference_mode = True
        config.save_pretrained(out)
        self.save_training_state(path)
        return self._checkpoint_info(path)

    def load(self, path: str | Path, *, checkpoint: str | None = None) -> CheckpointInfo:
        """Load the agent's adapter and training state saved by `save` into the shared model, in place."""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        path, name = Path(path), self.name
        marker = path / SOURCE_MARKER
        if marker.exists():
            check_same_source(name, json.loads(marker.read_text()), _frozen_source(self.agent),
                              checkpoint=checkpoint or str(path), where=self.where)
            return self._checkpoint_info(path)
        adapter_dir = path / ADAPTER_DIR
        if not (adapter_dir / "adapter_model.safetensors").is_file():
            raise ValueError(f"agent {name!r} is an adapter agent but its checkpoint {path} holds no "
                             f"{ADAPTER_DIR}/adapter_model.safetensors (was it saved by a full-model agent?); resume "
                             "with the run's agents.NAME.adapter setting")
        weights = load_file(adapter_dir / "adapter_model.safetensors", device=str(self.device))
        with torch.no_grad():
            result = set_peft_model_state_dict(self.model, weights, adapter_name=adapter_name(name))
        unexpected = [k for k in result.unexpected_keys if _owner(k) is not None]
        if unexpected:
            raise ValueError(f"agent {name!r}: the adapter in {adapter_dir} does not fit agents.{name}.adapter "
                             f"({len(unexpected)} unexpected tensors, first {unexpected[0]}); resume with its settings")
        self.from_checkpoint = True
        self.engine.sync(self.model)
        self.load_training_state(path)  # its RNG state: `selected` keeps it as this agent's on the way out
        return self._checkpoint_info(path)


def saved_names(parameters: dict[str, torch.nn.Parameter], agent: str) -> dict[str, str]:
    """Agent `agent`'s adapter parameter name -> the name peft saves it under (`get_peft_model_state_dict`: the
    adapter's name taken out, `...q_proj.lora_A.agent_a.weight` -> `...q_proj.lora_A.weight`)."""
    return {n: n.replace(f".{adapter_name(agent)}", "") for n in parameters}


def _owner(parameter_name: str) -> str | None:
    """The adapter a peft parameter belongs to (`...q_proj.lora_A.NAME.weight` -> NAME), or None for the base."""
    parts = parameter_name.split(".")
    for i in range(1, len(parts)):
        if parts[i - 1].startswith("lora_"):
            return parts[i]
    return None


def own_parameters(model, agent: str) -> dict[str, torch.nn.Parameter]:
    """Agent `agent`'s adapter parameters in the shared model."""
    return {n: p for n, p in model.named_parameters() if _owner(n) == adapter_name(agent)}


def _frozen_source(agent: AgentConfig) -> dict[str, Any]:
    path = agent.adapter.path
    return {"model": agent.model, "fingerprint": source_fingerprint(agent.model), "adapter": path,
            "adapter_fingerprint": source_fingerprint(path) if path else {}}


# ----------------------------------------------------------------------------------------- export
def merged_model(agent: AgentConfig, adapter_dir: Path):
    """The base with the saved adapter at `adapter_dir` merged into its weights (float32): a plain HF model,
    and the base's tokenizer. An adapter on the output head or the input embedding of a model that ties the
    two unties them first (merging into the shared matrix would change both)."""
    from peft import PeftModel

    base, tokenizer = load_model(agent.model, tokenizer=agent.tokenizer, dtype="float32")
    targets = json.loads((adapter_dir / "adapter_config.json").read_text()).get("target_modules") or []
    targets = {targets} if isinstance(targets, str) else set(targets)
    embeddings = {n.rsplit(".", 1)[-1] for n, m in base.named_modules()
                  if m is base.get_output_embeddings() or m is base.get_input_embeddings()}
    if getattr(base.config, "tie_word_embeddings", False) and targets & embeddings:
        head = base.get_output_embeddings()
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        base.config.tie_word_embeddings = False
    model = PeftModel.from_pretrained(base, adapter_dir)
    return model.merge_and_unload(), tokenizer
