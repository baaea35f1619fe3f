"""The critic: a learned value function, served by a host like an agent. The worked example of adding a kind.

A kind is two classes, as the agent's are: what its host serves (`Critic` here, beside `agent.Agent`: no
torch, the coordinator imports it to name the methods it calls) and its trainer (`critic_trainer.CriticTrainer`,
beside `trainer.AgentTrainer`), plus its typed messages (`protocols/messages.py`) and its config section.

A critic values states of an episode that the coordinator writes as text (`orchestrator.credit`) and learns
from the lambda-returns of each step (`algorithm.baseline: critic`, the `critic` section; the maths in
docs/rl-maths.md). It is a kind beside the agent, and everything the run does to an agent's process it
does to a critic's:

- **Placed.** The run plan's `member_layout` (`protocols.plan`) puts each critic in a host: one of its own
  (`placement: own`, with `critic.resources`) or its agent's (`placement: agent`). `hosts.Host` starts it after
  the host's agents, so that a head on an agent's model (`model: agent`) finds that model there.
- **Served.** `Critic` below is what a host serves for it: `values` and `update` are its own methods, each
  declaring its dispatch (`@register`), and save, load, probe and digest come from `agent.Served`, the
  methods every kind answers alike. A pool reaches it by name like an agent: `pool.each(Critic.values, ...)`.
- **Checkpointed and restored.** `critic_trainer.CriticTrainer.save(path)` / `load(path)` write and read
  its files in its directory of a checkpoint (`agents/critic` or `agents/critic-NAME`), through the same
  store as an agent's; the coordinator saves and loads critics with the agents (`Coordinator.members`).
- **Restarted.** A critic lives in a host like any agent, so a dead host is restarted with the rest and the
  critic reloaded from the last checkpoint.

The value model, its update and where they depart from PPO: `agent_trainer.critic_trainer`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from agent_trainer.agent import Served
from agent_trainer.dispatch import Dispatch, check_registered, register
from protocols.messages import CriticUpdateRequest, CriticUpdateResult, ValueRequest, ValueResult

if TYPE_CHECKING:
    from agent_trainer.critic_trainer import CriticTrainer


@check_registered
class Critic(Served):
    """A critic as its host serves it: `values` and `update`, and `Served`'s save, load, probe and digest."""

    _trainer: CriticTrainer

    @register(Dispatch.RANK_ZERO)
    def values(self, request: ValueRequest) -> ValueResult:
        start = time.perf_counter()
        values = self._trainer.values(request.states)
        return ValueResult(critic=self._trainer.name, values=values, seconds=time.perf_counter() - start)

    @register(Dispatch.ALL_EQUAL)
    def update(self, request: CriticUpdateRequest) -> CriticUpdateResult:
        return self._trainer.update(request.targets)
