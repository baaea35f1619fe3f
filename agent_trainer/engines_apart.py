"""Rollout engines of their own (`rollout.placement: separate`): how the Ray pool (`agent_trainer.actor.RayTrainers`)
gets each policy version from an agent's learner into its engine actor, never through the coordinator.

By `rollout.weight_transfer: group`, a torch.distributed group of the two processes formed at start
(`agent_trainer.weight_channel`): the engine holds one version, the learner's current one when it was sent. By
`store`, or where no group could be formed: the learner puts each version into Ray's object store
(`agent_trainer.weight_wire`) and the engine takes the one a generate names. Either way a generate names its
version, and the engine refuses one it does not hold."""

from __future__ import annotations

import threading
from typing import Any, Callable

import ray

from agent_trainer.agent import Agent
from agent_trainer.dispatch import declaration_of
from agent_trainer.handle import TrainerFailure, TrainerStartError
from agent_trainer.weight_channel import ChannelRefused
from protocols.config import RunConfig
from protocols.errors import describe, one_line


class EnginesApart:
    """The engines-apart part of the Ray pool. The pool sets `workers` (agent -> its actors), `engines` (agent -> its
    engine's actor) and `housemates`, and has `timeout_of` and `close`."""

    workers: dict[str, list]
    engines: dict[str, Any]
    housemates: dict[str, list[str]]  # agent -> the agents of its host (its learner's process)
    timeout_of: Callable
    close: Callable

    def _start_engines_apart(self) -> None:
        self.published: dict[str, dict[int, Any]] = {a: {} for a in self.engines}  # version -> object ref (store)
        self.engine_version: dict[str, int | None] = dict.fromkeys(self.engines)
        self.planned: dict[str, int] = {}  # agent -> the last version a rollout named
        self.sync_lock = threading.RLock()  # also held from a generate's sync until the generate is sent (`_fan_out`)
        self.channels: dict[str, str] = {}  # agent -> its weight channel's backend (rollout.weight_transfer: group)

    @property
    def engines_pushed(self) -> frozenset[str]:
        """Agents whose engine is fed by a weight channel: it holds one version, its learner's current one."""
        return frozenset(getattr(self, "channels", ()))

    def _open_channels(self, config: RunConfig, info: dict[str, dict[str, Any]], addresses: dict[str, str]) -> None:
        """Form the weight channel (`agent_trainer.weight_channel`) of each agent whose engine is apart with
        `rollout.weight_transfer: group`; where none can be formed, its weights go through the object store. What
        each agent got is under `weight_transfer` in its start info."""
        timeout_s = self.timeout_of(Agent.send_weights) or 7 * 24 * 3600.0  # a transfer: as long as any call
        rendezvous_s = min(60.0, config.train.start_timeout_s or 60.0)
        for agent, engine in self.engines.items():
            if config.agents[agent].rollout.weight_transfer != "group":
                info[agent]["weight_transfer"] = "Ray's object store (rollout.weight_transfer: store)"
                continue
            if (gpu := shared_gpu(info[agent], info[agent]["rollout_engine"])) is not None:
                info[agent]["weight_transfer"] = (f"Ray's object store (its learner and its rollout engine share GPU "
                                                  f"{gpu}, and NCCL refuses two ranks on one device)")
                continue
            learner, refs = self.workers[agent][0], []
            address = addresses[agent]
            try:
                port = ray.get(learner.open_weight_store.remote(agent, address=address, timeout_s=rendezvous_s),
                               timeout=rendezvous_s)
                local = info[agent]["node"] == info[agent]["rollout_engine"]["node"]
                refs = [actor.join_weight_channel.remote(agent, address=address, port=port, rank=rank,
                                                         rendezvous_s=rendezvous_s, timeout_s=timeout_s, local=local)
                        for rank, actor in enumerate((learner, engine))]
                backend, _ = ray.get(refs, timeout=2 * rendezvous_s)
            except ray.exceptions.RayActorError as exc:
                self.close()
                raise TrainerStartError(f"agent {agent!r}: its learner or its rollout engine died while they formed "
                                        f"their weight channel ({one_line(exc)[:200]})") from None
            except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as exc:
                ray.wait(refs, num_returns=len(refs), timeout=2 * rendezvous_s)  # neither side waits on: both are free
                reason = (describe(exc.cause or exc) if isinstance(exc, ray.exceptions.RayTaskError)
                          else f"no rendezvous at {address} within {2 * rendezvous_s:g}s")
                info[agent]["weight_transfer"] = f"Ray's object store (no process group could be formed: {reason})"
                continue
            self.channels[agent] = backend
            info[agent]["weight_transfer"] = (f"a {backend} group with its learner"
                                              + (", into shared memory on their node" if local and backend == "gloo"
                                                 else ""))

    def push_weights(self, agent: str) -> None:
        """Put `agent`'s learner's current weights into its engine now, unless it holds them: an engine fed by a
        weight channel can take only those, so the pipeline pushes them before the learner moves on."""
        with self.sync_lock:
            newest = max(self.published[agent])
        self._sync_engine(agent, newest)

    def push_before_update(self, agents: list[str]) -> None:
        """`push_weights` for each of `agents` fed by a weight channel and for each agent of their hosts: the update
        keeps their learner's process busy, and a transfer asked of it meanwhile would wait for the update's end."""
        for agent in sorted({h for a in agents for h in self.housemates[a]} & self.engines_pushed):
            self.push_weights(agent)

    def _publish(self, agents: list[str], versions: dict[str, int] | None = None) -> None:
        """Each learner of `agents` puts its weights into the object store, under its policy version (asked when not
        given: at start and after a load, which also forget what was published before). Nothing passes the driver:
        the engine takes the weights from the store when a generate asks for that version."""
        for agent in agents:
            learner = self.workers[agent][0]
            if versions is None:
                version = ray.get(learner.call.remote(agent, _declared(Agent.version)), timeout=self.timeout_of(Agent.version))
            else:
                version = versions[agent]
            channel = agent in self.channels  # the learner sends its live weights when the engine needs them
            ref = None if channel else learner.call.remote(agent, _declared(Agent.published_weights))
            with self.sync_lock:
                if versions is None or channel:  # a channel's learner holds one version: its current one
                    self.published[agent] = {}
                if versions is None:
                    self.engine_version[agent] = None
                    self.planned.pop(agent, None)
                self.published[agent][version] = ref

    def _sync_engine(self, agent: str, version: int | None) -> None:
        """Put the learner's weights of policy `version` (None: the newest published, as an evaluation asks) into
        `agent`'s engine, unless it holds them. Rollouts name the versions they plan, in order: versions older than
        the last one named are forgotten (all but the newest, while none is named)."""
        with self.sync_lock:
            published = self.published[agent]
            if version is not None:
                self.planned[agent] = version
            version = max(published) if version is None else version
            if self.engine_version[agent] == version:
                return
            if version not in published:
                held = ("which its learner no longer holds (a weight channel sends only the learner's current "
                        f"version, {max(published)})" if agent in self.channels
                        else f"which its learner has not published (published: {sorted(published)})")
                raise TrainerFailure(agent, "generate", f"its rollout engine was asked for policy version {version}, "
                                     f"{held}", False)
            if agent in self.channels:
                self._send(agent, version)
                self.engine_version[agent] = version
                return
            ref = published[version]
            try:
                ray.get(self.engines[agent].call.remote(agent, _declared(Agent.take_weights), ref, version),
                        timeout=self.timeout_of(Agent.take_weights))
            except ray.exceptions.GetTimeoutError:
                raise TrainerFailure(agent, "generate", "its rollout engine took no weights within "
                                     f"{self.timeout_of(Agent.take_weights):g}s (hung)", True) from None
            except ray.exceptions.RayActorError as exc:
                raise TrainerFailure(agent, "generate", f"its rollout engine's process, or its learner's, died "
                                     f"({one_line(exc)[:200]})", True) from None
            except ray.exceptions.RayTaskError as exc:
                raise TrainerFailure(agent, "generate", f"its rollout engine could not take the weights: "
                                     f"{describe(exc.cause or exc)}", False) from None
            self.engine_version[agent] = version
            floor = self.planned.get(agent, version)
            for old in [v for v in published if v < floor]:
                del published[old]

    def _send(self, agent: str, version: int) -> None:
        """`agent`'s learner's weights at policy `version` into its engine over their channel, both sides at once.
        A side that dies or hangs is a recoverable failure; a refused transfer (a version the learner does not
        hold, tensors that differ) is not."""
        timeout, backend = self.timeout_of(Agent.send_weights), self.channels[agent]
        self.engine_version[agent] = None  # until every tensor is in
        refs = {self.workers[agent][0].send_weights.remote(agent, version): "learner",
                self.engines[agent].receive_weights.remote(agent, version): "rollout engine"}
        what = f"the {backend} broadcast of policy version {version}"
        _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        if pending:
            raise TrainerFailure(agent, "generate", f"{what} to its rollout engine did not end within {timeout:g}s "
                                 f"(hung; its {refs[pending[0]]} waits)", True)
        died, failed = {}, {}
        for ref, side in refs.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                died[side] = exc
            except ray.exceptions.RayTaskError as exc:
                failed[side] = exc.cause or exc
        if died:
            side, exc = next(iter(died.items()))
            raise TrainerFailure(agent, "generate", f"its {side}'s process died during {what} "
                                 f"({one_line(exc)[:200]})", True)
        refused = [e for e in failed.values() if isinstance(e, ChannelRefused)]
        if refused:  # the side that says why first
            raise TrainerFailure(agent, "generate", min(refused, key=lambda e: e.by_peer).reason, False)
        if failed:  # a collective broken by the other side's death, not yet reported
            side, exc = next(iter(failed.items()))
            raise TrainerFailure(agent, "generate", f"{what} to its rollout engine failed on its {side}: "
                                 f"{describe(exc)}", True)


def shared_gpu(learner: dict[str, Any], engine: dict[str, Any]) -> str | None:
    """The GPU a learner and its engine apart both hold on one node (from their actors' `info`: fractions of one
    GPU), or None: a weight channel between them cannot be an NCCL group."""
    if learner["node"] != engine["node"]:
        return None
    both = sorted(set(learner["gpu_ids"]) & set(engine["gpu_ids"]))
    return both[0] if both else None


def _declared(method: Callable) -> str:
    """The name under which a served method declares itself, by which a trainer actor finds it."""
    return declaration_of(method).name
