"""`Agent`: one agent as its host process serves it, behind the handle's typed methods.

Each method is what a handle (`agent_trainer.handle.AgentHandle`, generated from these methods) call runs in
the agent's host process, and declares how it fans out over the agent's data-parallel workers, its timeout
class, and whether it goes to a rollout engine of its own or publishes weights to it (`agent_trainer.dispatch`). Every call
runs inside the trainer's `selected` context (an adapter agent's adapter and RNG state in place; nothing
for a full-model agent). A method added here without `@register` is refused where the class is defined.

`Served` holds what every kind a host serves answers alike (save, load, probe, digest): an agent and a critic
(`agent_trainer.critic.Critic`, the worked example of a new kind) are checkpointed, restored and checked
through the same methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_trainer import process_memory, storage
from agent_trainer.dispatch import Dispatch, Publish, Timeout, check_registered, register
from protocols.messages import (
    GenerateRequest, GenerateResult, LoadRequest, MemoryReading, OptimizerRequest, ProbeRequest, SaveRequest,
    ScoreRequest, StoredFiles, UpdateRequest, UpdateResult, WeightDigests,
)

if TYPE_CHECKING:
    from agent_trainer.trainer import AgentTrainer


@check_registered
class Served:
    """What a host serves of any kind: a trainer with `selected()`, `save(path)`, `load(path)` and
    `parameters_digest()`, checkpointed through the store (`agent_trainer.storage`)."""

    def __init__(self, trainer):
        self._trainer = trainer

    @register(Dispatch.RANK_ZERO, timeout=Timeout.CHECKPOINT)
    def save(self, request: SaveRequest) -> StoredFiles:
        with self._trainer.selected():
            return storage.save(self._trainer, target=request.target)

    @register(Dispatch.ALL_EQUAL, timeout=Timeout.CHECKPOINT, publishes=Publish.RELOADED)
    def load(self, request: LoadRequest) -> str | None:
        """Why the checkpoint's copy on this node is damaged (nothing is loaded then), or None once loaded."""
        with self._trainer.selected():
            return storage.load(self._trainer, source=request.source, files=request.files)

    @register(Dispatch.ALL_TRUE, timeout=Timeout.CHECKPOINT)
    def probe(self, request: ProbeRequest) -> bool:
        return storage.probe(where=request.where, token=request.token, agent=request.agent)

    @register(Dispatch.RANK_ZERO)
    def digest(self) -> str:
        """SHA-256 of the weights the agent computes with."""
        with self._trainer.selected():
            return self._trainer.parameters_digest()

    @register(Dispatch.ROWS)
    def memory(self, step: int) -> MemoryReading:
        """The peak memory of the member's processes during `step` (since the reading before): every worker
        answers its own process's share, and the shares add up (`agent_trainer.process_memory`)."""
        return process_memory.reading(step)


@check_registered
class Agent(Served):
    """The trainer of one agent (a full-model `AgentTrainer`, or an `adapters.AdapterTrainer`), served."""

    _trainer: AgentTrainer

    @register(Dispatch.ROWS, engine=True)
    def generate(self, request: GenerateRequest) -> GenerateResult:
        with self._trainer.selected():
            return self._trainer.generate(request)

    @register(Dispatch.ALL_EQUAL, publishes=Publish.UPDATED)
    def update(self, request: UpdateRequest) -> UpdateResult:
        with self._trainer.selected(updating=True):
            return self._trainer.update(request)

    @register(Dispatch.ALL_EQUAL)
    def hold_optimizer(self, request: OptimizerRequest) -> None:
        """Release the optimizer state, or fetch it back in the background (`orchestrator.memory_plan`); every
        worker holds its own."""
        self._trainer.hold_optimizer(request.keep)

    @register(Dispatch.RANK_ZERO)
    def weight_digests(self) -> WeightDigests:
        with self._trainer.selected():
            return self._trainer.weight_digests()

    @register(Dispatch.RANK_ZERO, timeout=Timeout.CHECKPOINT)
    def version(self) -> int:
        """The policy version of the weights the agent computes with (its updates so far)."""
        return self._trainer.policy_version

    @register(Dispatch.RANK_ZERO)
    def published_weights(self) -> dict:
        """The weights, on the CPU, for a rollout engine in another process (`rollout.placement: separate`), packed
        for the object store (`weight_wire.pack`: views of the live weights, which Ray copies into the store as this
        call returns); the Ray pool leaves them there, where the engine takes them."""
        from agent_trainer import weight_wire  # torch: the coordinator, which imports this class, imports none

        with self._trainer.selected():
            return weight_wire.pack(self._trainer.published_weights())

    @register(Dispatch.RANK_ZERO)
    def take_weights(self, weights: dict, version: int) -> None:
        """An engine process: sample with `weights` (`published_weights`' payload), the learner's at policy
        `version`, from now on."""
        from agent_trainer import weight_wire

        with self._trainer.selected():
            self._trainer.take_weights(weight_wire.unpack(weights), version)

    @register(Dispatch.RANK_ZERO)
    def send_weights(self, channel: Any, version: int) -> int:
        """The learner: send its weights, as policy `version`, over `channel` (`weight_channel.WeightChannel`, which
        its trainer process holds) to the engine receiving them; the bytes sent."""
        with self._trainer.selected():
            return channel.send(self._trainer.published_weights(), version, self._trainer.policy_version)

    @register(Dispatch.RANK_ZERO)
    def receive_weights(self, channel: Any, version: int) -> None:
        """An engine process: receive the learner's weights at policy `version` over `channel`, into its own."""
        with self._trainer.selected():
            self._trainer.receive_weights(channel, version)

    @register(Dispatch.RANK_ZERO)
    def score(self, request: ScoreRequest) -> list[list[float]]:
        """Log-probs of each completion token under the full softmax at temperature 1 (`AgentTrainer.score`)."""
        with self._trainer.selected():
            return self._trainer.score(request.experiences, engine=request.engine)

    @register(Dispatch.RANK_ZERO)
    def per_token_logps(self, request: ScoreRequest) -> list[list[float]]:
        """Log-probs of each completion token under the sampling distribution (`AgentTrainer.per_token_logps`)."""
        with self._trainer.selected():
            return self._trainer.per_token_logps(request.experiences)
