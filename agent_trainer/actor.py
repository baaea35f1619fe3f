"""The Ray wrapper: one actor per host worker, placed by a placement group, each on its own GPU or CPU share.

A host (`agent_trainer.hosts`) holds one full-model agent, or adapter agents sharing a base model. A
full-model agent with `resources.num_workers: K` is a host of K actors joined into one torch.distributed
group (`agent_trainer.workers`). `RayTrainers` is the pool (`agent_trainer.handle.TrainerPool`): a call goes
to the workers its method's declared dispatch names (`agent_trainer.dispatch`), which also makes the agent's
one answer of theirs, so callers see one agent; its declaration also says whether it goes to the agent's
rollout engine of its own and whether it publishes the learner's weights to that engine."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agent_trainer import priority, reaper
from agent_trainer.agent import Agent
from agent_trainer.dispatch import Publish, WorkersDisagree, declaration_of
from agent_trainer.handle import PlacementError, TrainerFailure, TrainerPool, TrainerStartError
from agent_trainer.engines_apart import EnginesApart
from agent_trainer.group import bundle_of, fit_problem, local_cluster_problem
from protocols.config import EnginePriority, RayConfig, RunConfig, joins_cluster
from protocols.errors import describe, one_line
from protocols.messages import ForwardedEnv
from protocols.plan import RunPlan, plan_of


# Ray logs this on every start of a local cluster (and on joining one when a token file exists): a notice that
# its default, token authentication, is on. marsi leaves that default as it is and drops the notice; Ray's
# other messages (a warning that authentication is off included) still show.
_RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_RAY_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster."


def _not_auth_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_RAY_AUTH_NOTICE)


def quiet_ray_startup() -> None:
    """Hide Ray's start-up notice that token authentication is on; nothing about authentication changes."""
    logger = logging.getLogger(_RAY_AUTH_LOGGER)
    if _not_auth_notice not in logger.filters:
        logger.addFilter(_not_auth_notice)


def drop_blank_worker_lines(dispatcher=None) -> None:
    """Ray prints every line a trainer writes on this console after a `(_TrainerActor pid=N)` prefix, blank lines
    too (a prefix alone). Its printer is the `ray_print_logs` handler of the driver's stdstream dispatcher
    (`log_to_driver`); it is wrapped here so that batches lose their blank lines first. Ray's other output, its
    deduplication included, is unchanged; a Ray without that dispatcher is left as it is."""
    if dispatcher is None:
        try:
            from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
        except ImportError:
            return
    with dispatcher._lock:
        dispatcher.handlers = [(name, _without_blank_lines(handler) if name == "ray_print_logs" else handler)
                               for name, handler in dispatcher.handlers]


def _without_blank_lines(handler: Callable) -> Callable:
    if getattr(handler, "drops_blank_lines", False):
        return handler

    def handle(data: dict) -> None:
        if "lines" not in data:
            handler(data)
            return
        lines = [line for line in data["lines"] if line.strip()]
        if lines:
            handler({**data, "lines": lines})

    handle.drops_blank_lines = True
    return handle


def init_ray(config: RayConfig) -> bool:
    """Join `config.address` or RAY_ADDRESS when set, else start a local cluster, watched so that it ends with
    this process however this process ends (agent_trainer/reaper.py); False if Ray was already up."""
    if ray.is_initialized():
        return False
    quiet_ray_startup()
    address = config.address or os.environ.get("RAY_ADDRESS")
    with _own_signal_handling():
        if address:
            ray.init(address=address, logging_level="WARNING")
        else:
            context = ray.init(num_cpus=config.num_cpus, num_gpus=config.num_gpus, include_dashboard=False,
                               logging_level="WARNING")
            reaper.watch(context.address_info["session_dir"])  # ends the cluster if this process is killed
    drop_blank_worker_lines()
    return True


def start_ray(config: RunConfig, plan: RunPlan) -> bool:
    """`init_ray`, having checked first that the cluster can place the trainers (`fit_problem`): a local cluster
    against this machine's node before it starts, a cluster marsi joins once joined (and then left again). A
    problem is one PlacementError, with nothing said before it; False if Ray was already up."""
    if not ray.is_initialized() and not joins_cluster(config.ray):
        problem = local_cluster_problem(config, plan)
        if problem:
            raise PlacementError(problem)
    owns = init_ray(config.ray)
    problem = cluster_problem(config, plan)
    if problem:
        if owns:
            ray.shutdown()
        raise PlacementError(problem)
    if owns and joins_cluster(config.ray):
        print(f"marsi: joined the Ray cluster at {config.ray.address or os.environ['RAY_ADDRESS']}", file=sys.stderr)
    return owns


@contextlib.contextmanager
def _own_signal_handling():
    """Keep this process's own SIGINT and SIGTERM handlers (Python functions, such as `marsi run`'s) through
    `ray.init`, whose driver puts in its own for SIGTERM (`sys.exit(15)`, then a C++ handler that prints a stack
    dump): they are put back after it, and a SIGTERM that Ray's handler took meanwhile goes to this process's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except SystemExit as exc:
        if exc.code == signal.SIGTERM and callable(handlers[signal.SIGTERM]):
            handlers[signal.SIGTERM](signal.SIGTERM, None)
        raise
    finally:
        for s, handler in handlers.items():
            if callable(handler):
                signal.signal(s, handler)


class _TrainerActor:
    """Holds one host (`agent_trainer.hosts.Host`): its agents' trainers; Ray pins it to its bundle, and
    CUDA_VISIBLE_DEVICES to its GPU."""

    def __init__(self, host, config, plan, updates, threads, forwarded: ForwardedEnv | None = None,
                 lowered: EnginePriority | None = None):
        """`lowered`: lower the process's priority so first (an engine apart: `RunPlan.engine_priority`)."""
        if forwarded is not None:
            forwarded.apply()  # before anything reads the environment (the store's client, the model hub's)
        if lowered is not None:
            priority.lower(lowered)
        started = time.perf_counter()
        import torch

        from agent_trainer.heap import return_freed_memory
        from agent_trainer.hosts import Host

        return_freed_memory()
        torch.set_num_threads(threads)
        self.node = node_label(ray.get_runtime_context().get_node_id())
        self.host, self.error = None, None
        self.group_store = None  # worker 0 of a data-parallel agent: its group's store, from open_store to join
        self.channel_stores: dict[str, Any] = {}  # agent -> its weight channel's store (its learner: the master)
        self.channels: dict[str, Any] = {}  # agent -> its weight channel (`weight_channel.WeightChannel`)
        try:
            self.host = Host(host, config, plan, updates, where=self.node)
        except TrainerStartError as exc:  # reported by info(), so the driver gets one clean line
            self.error = str(exc)
        self.start_s = time.perf_counter() - started  # imports, the models, the optimizer

    def call(self, agent: str, method: str, *args: Any) -> Any:
        """The method of what `agent` is served as (an `Agent`, or a `critic.Critic`) that declares itself under
        the name `method` (`agent_trainer.dispatch.Declaration.name`)."""
        return self.host.call(agent, getattr(type(self.host.served[agent]), method), *args)

    def open_store(self, *, address: str, world_size: int, timeout_s: float) -> int:
        """Worker 0 of a data-parallel agent: open its group's store at `address`, kept until it joins; the port."""
        from agent_trainer import workers

        self.group_store = workers.open_store(address=address, world_size=world_size, timeout_s=timeout_s)
        return self.group_store.port

    def join_group(self, *, address: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Join this host's (one) agent to its data-parallel group as worker `rank`."""
        from agent_trainer import workers

        (trainer,) = self.host.trainers.values()
        store, self.group_store = self.group_store, None
        workers.join(trainer, address=address, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s,
                     store=store)

    def open_weight_store(self, agent: str, *, address: str, timeout_s: float) -> int:
        """`agent`'s learner: open the store of its weight channel to its engine at `address`; the port."""
        from agent_trainer import workers

        self.channel_stores[agent] = workers.open_store(address=address, world_size=2, timeout_s=timeout_s)
        return self.channel_stores[agent].port

    def join_weight_channel(self, agent: str, *, address: str, port: int, rank: int, rendezvous_s: float,
                            timeout_s: float, local: bool) -> str:
        """Join `agent`'s weight channel (`agent_trainer.weight_channel`) as its learner (rank 0, which opened the
        store) or its engine (rank 1); the backend. `timeout_s` bounds each transfer; `local`: both on one node."""
        import datetime

        import torch.distributed as dist

        from agent_trainer.weight_channel import WeightChannel

        if agent not in self.channel_stores:
            self.channel_stores[agent] = dist.TCPStore(address, port, 2, is_master=False,
                                                       timeout=datetime.timedelta(seconds=rendezvous_s))
        device = self.host.trainers[agent].device
        self.channels[agent] = WeightChannel(self.channel_stores[agent], rank, device=device, timeout_s=timeout_s,
                                             agent=agent, local=local)
        return self.channels[agent].backend

    def send_weights(self, agent: str, version: int) -> int:
        """`agent`'s learner: its weights at policy `version` over its channel; the bytes sent."""
        return self.host.call(agent, Agent.send_weights, self.channels[agent], version)

    def receive_weights(self, agent: str, version: int) -> None:
        """`agent`'s engine: the learner's weights at policy `version`, over its channel."""
        self.host.call(agent, Agent.receive_weights, self.channels[agent], version)

    def info(self) -> dict[str, dict[str, Any]]:
        """Per agent of this host: its process, node, device, precision (`agent_trainer.precision.Precision` as a
        dict) and engine, the seconds this actor took to start and those its model took to load (the start error,
        if any, under "")."""
        common = {"pid": os.getpid(), **priority.current(), "error": self.error, "start_s": self.start_s,
                  "node": ray.get_runtime_context().get_node_id(),
                  "node_label": self.node, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}
        if self.host is None:
            return {"": {**common, "device": None, "engine": None}}
        return {name: {**common, "host": self.host.name, "device": str(t.device),
                       "engine": getattr(t.engine, "name", None),
                       "load_s": t.load_seconds, "precision": t.precision._asdict()}
                for name, t in self.host.trainers.items()}


def actor_extras(r, runtime_env: dict[str, Any] | None) -> dict[str, Any]:
    """Ray actor options of one worker besides CPUs, GPUs and its bundle: custom resources, GPU type, environment."""
    extras: dict[str, Any] = {}
    if r.custom:
        extras["resources"] = dict(r.custom)
    if r.accelerator_type:
        extras["accelerator_type"] = r.accelerator_type
    if runtime_env:
        extras["runtime_env"] = runtime_env
    return extras


def trainer_env(config: RayConfig) -> dict[str, Any] | None:
    """The runtime_env of every trainer: `ray.env_vars` (recorded like every setting, so no secrets). The
    `ray.forward_env` variables do not go here: Ray's runtime_env agent writes what it is given to its log, which
    outlives the run (`forwarded_env`)."""
    return {"env_vars": dict(config.env_vars)} if config.env_vars else None


def forwarded_env(config: RayConfig, environ: dict[str, str] | None = None) -> ForwardedEnv:
    """The `ray.forward_env` variables as this process has them (a name it lacks is a PlacementError naming it), for
    every trainer's constructor, which sets them in its process before anything else: they travel inside Ray's
    call, and no log or file records them."""
    environ = os.environ if environ is None else environ
    missing = [name for name in config.forward_env if name not in environ]
    if missing:
        raise PlacementError(f"ray.forward_env: {', '.join(missing)} not set in this process's environment; set "
                             "them in the shell that runs marsi, or remove them from ray.forward_env")
    return ForwardedEnv(values={name: environ[name] for name in config.forward_env})  # set after env_vars: they win


def placement_plan(resources: dict[str, Any], strategy: str) -> list[tuple[str, list[str]]]:
    """The trainers' placement groups, each (its strategy, the hosts whose workers it holds): one group of every
    host, placed by `strategy` (ray.placement_strategy), unless a host sets its own resources.placement_strategy;
    then one group per host, placed by its own strategy or `strategy`."""
    if not any(r.placement_strategy for r in resources.values()):
        return [(strategy, list(resources))]
    return [(r.placement_strategy or strategy, [host]) for host, r in resources.items()]


def group_request(resources: dict[str, Any], hosts: list[str]) -> dict[str, Any]:
    """`placement_group` keyword arguments of one group of `hosts`' workers: a bundle per worker, and the node
    label selector of each bundle where any host has one."""
    bundles = [bundle_of(resources[h]) for h in hosts for _ in range(resources[h].num_workers)]
    selectors = [dict(resources[h].label_selector) for h in hosts for _ in range(resources[h].num_workers)]
    return {"bundles": bundles, **({"bundle_label_selector": selectors} if any(selectors) else {})}


def cluster_problem(config: RunConfig, plan: RunPlan) -> str | None:
    """Why the Ray cluster this process is connected to can never place the trainers (too few CPUs or GPUs in
    all, a custom resource or GPU type no node has, a label selector no live node matches), or None."""
    return fit_problem(config, plan, ray.cluster_resources(), ray.nodes(), "the Ray cluster")


def nodes_note(spread: int | None) -> str:
    """What the cluster's nodes say about a placement that did not happen: nodes lost since they joined, and how
    many nodes a STRICT_SPREAD group of `spread` workers needs (free capacity in all can cover a request no node
    can); None: no STRICT_SPREAD group."""
    nodes = ray.nodes()
    alive = [n for n in nodes if n.get("Alive")]
    lost = [node_label(n["NodeID"]) for n in nodes if not n.get("Alive")]
    note = f"; STRICT_SPREAD needs {spread} nodes, the cluster has {len(alive)} alive" if spread else ""
    if lost:
        note += f"; lost from the cluster: {', '.join(lost)}"
    return note


def engine_config(config: RunConfig, host: str, agents: list[str], resources) -> RunConfig:
    """The config the rollout engine of host `host` (its `agents`, `RunPlan.engine_layout`) starts from: the agents
    frozen (their weights come from their learner), sampling in one process with the engine's `resources`
    (`RunPlan.engine_resources`): on a shared host, one base and each agent's adapter."""
    specs = {}
    for agent in agents:
        spec = config.agents[agent]
        rollout = spec.rollout.model_copy(update={"placement": "colocated", "resources": None})
        specs[agent] = spec.model_copy(update={"rollout": rollout} if spec.host else
                                       {"rollout": rollout, "resources": resources})
    hosts = config.hosts
    if host in hosts:
        hosts = {**hosts, host: hosts[host].model_copy(update={"resources": resources})}
    schedule = config.schedule.model_copy(update={"frozen": [*config.schedule.frozen, *agents]})
    return config.model_copy(update={"agents": {**config.agents, **specs}, "hosts": hosts, "schedule": schedule})


def engine_plan(engine: RunConfig) -> RunPlan:
    """The plan of an engine's config (`engine_config`): its hosts hold the agents only, for an engine samples and
    never values (a critic placed with an agent stays in the agent's learner process)."""
    plan = plan_of(engine)
    return replace(plan, member_layout=plan.host_layout)


def node_label(node_id: str) -> str:
    """`node NAME (IP, id 0123abcd...)`: how messages name a Ray node (its name is its IP unless set with
    `ray start --node-name`)."""
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            name, ip = node.get("NodeName") or "?", node.get("NodeManagerAddress") or "?"
            return f"node {name} ({'' if name == ip else ip + ', '}id {node_id[:12]})"
    return f"node {node_id[:12]}"


class RayTrainers(EnginesApart, TrainerPool):
    """One Ray actor per host worker; a call fans out to all named agents' workers, then gathers once.
    `workers[agent]` lists the actors of an agent's host in worker order.
    Agents of one host are served by one actor, one call at a time; its death is a failure of each of them.
    `engines[agent]` is the actor of an agent's rollout engine of its own (`rollout.placement: separate`)."""

    engines: dict[str, Any] = {}  # set per pool in __init__; empty for a pool built without it
    engines_apart: frozenset[str] | set[str] = frozenset()

    def __init__(self, config: RunConfig, plan: RunPlan, updates: dict[str, int]):
        """`plan`: `config`'s (`protocols.plan`); `updates`: agent -> the updates it is scheduled for."""
        from agent_trainer.group import num_threads

        problem = cluster_problem(config, plan)
        if problem:  # cannot be placed at all: say so now rather than after placement_timeout_s
            raise PlacementError(problem)
        layout = plan.member_layout  # the agents' hosts, and the critics'
        self.agents = [*config.agents, *plan.critic_members]
        self.critics = set(plan.critic_members)
        self.call_timeout, self.checkpoint_timeout = config.train.call_timeout_s, config.train.checkpoint_timeout_s
        resources = plan.host_resources  # a host's agents share it; a critic's own host asks its own
        runtime_env, forwarded = trainer_env(config.ray), forwarded_env(config.ray)
        placement = placement_plan(resources, config.ray.placement_strategy)
        requests = [group_request(resources, hosts) for _, hosts in placement]
        apart = plan.engine_resources  # agents whose rollout engine is an actor of its own
        if apart:  # the engines in a group of their own, placed as the run's trainers are
            placement.append((config.ray.placement_strategy, []))
            requests.append({"bundles": [bundle_of(r) for r in apart.values()]})
        self.groups = [placement_group(strategy=strategy, **request)
                       for (strategy, _), request in zip(placement, requests)]
        try:
            ray.get([group.ready() for group in self.groups], timeout=config.ray.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._remove_groups()
            asked = ", ".join(f"{host}: {bundle_of(resources[host])}" for _, hosts in placement for host in hosts
                              for _ in range(resources[host].num_workers))
            asked += "".join(f", {agent} (rollout engine): {bundle_of(r)}" for agent, r in apart.items())
            spread = [len(r["bundles"]) for (strategy, _), r in zip(placement, requests) if strategy == "STRICT_SPREAD"]
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "memory")}
            raise PlacementError(
                f"trainers could not be placed within {config.ray.placement_timeout_s:.0f}s; asked for {asked}"
                f"{nodes_note(max(spread, default=None))}; cluster has free {free} in all; lower "
                "agents.<name>.resources or add nodes"
            ) from None
        actor_cls = ray.remote(_TrainerActor)
        self.layout, self.workers = layout, {}
        for group_of_hosts, (_, hosts) in zip(self.groups, placement):
            bundle = 0
            for host in hosts:
                r, workers = resources[host], []
                for _ in range(r.num_workers):  # each worker in a bundle of its own
                    workers.append(actor_cls.options(
                        num_cpus=r.num_cpus, num_gpus=r.num_gpus, **actor_extras(r, runtime_env),
                        scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group_of_hosts,
                                                                             placement_group_bundle_index=bundle),
                    ).remote(host, config, plan, updates, num_threads(r.num_cpus), forwarded))
                    bundle += 1
                self.workers.update(dict.fromkeys(layout[host], workers))
        self.engines = {}  # agent -> its rollout engine's actor (rollout.placement: separate), one per host
        for bundle, (host, r) in enumerate(apart.items()):
            agents = plan.engine_layout[host]
            engine = engine_config(config, host, agents, r)  # another config than the pool's: a plan of its own
            self.engines.update(dict.fromkeys(agents, actor_cls.options(
                num_cpus=r.num_cpus, num_gpus=r.num_gpus, **actor_extras(r, runtime_env),
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.groups[-1],
                                                                     placement_group_bundle_index=bundle),
            ).remote(host, engine, engine_plan(engine), updates, num_threads(r.num_cpus), forwarded,
                      plan.engine_priority[host])))
        self.engines_apart = set(self.engines)
        self._start_engines_apart()
        self.housemates = {agent: agents for agents in layout.values() for agent in agents}
        try:  # waits until every trainer is up, then joins each agent's workers into one group
            info = self.start_info = self.info(timeout=config.train.start_timeout_s)
            errors = [w["error"] for i in info.values() for w in i["workers"] if w["error"]]
            if not errors:
                self._join_workers(info, config.train.start_timeout_s, config.train.call_timeout_s)
        except TrainerStartError:
            self.close()
            raise
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise TrainerStartError(f"trainers were not up within train.start_timeout_s="
                                    f"{config.train.start_timeout_s:g}s after placement; raise it for large models "
                                    "or check the trainer processes") from None
        if errors:
            self.close()
            raise TrainerStartError(errors[0])
        self._open_channels(config, info, {a: _node_address(info[a]["node"]) for a in self.engines})
        self._publish(list(self.engines))

    def _join_workers(self, info: dict[str, dict[str, Any]], start_timeout: float | None,
                      call_timeout: float | None) -> None:
        """Join each multi-worker agent's actors into its process group: worker 0 opens the group's store
        on its node, then every worker joins at that address. Collectives time out after `call_timeout`."""
        groups = {name: group for name, group in self.workers.items() if len(group) > 1}
        if not groups:
            return
        timeout_s = call_timeout or 7 * 24 * 3600.0
        addresses = {name: _node_address(info[name]["node"]) for name in groups}
        ports = dict(zip(groups, ray.get([group[0].open_store.remote(
            address=addresses[name], world_size=len(group), timeout_s=timeout_s) for name, group in groups.items()],
            timeout=start_timeout)))
        joined = {actor.join_group.remote(address=addresses[name], port=ports[name], rank=rank, world_size=len(group),
                                          timeout_s=timeout_s): name
                  for name, group in groups.items() for rank, actor in enumerate(group)}
        for ref, name in joined.items():
            try:
                ray.get(ref, timeout=start_timeout)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                reason = (describe(exc.cause or exc) if isinstance(exc, ray.exceptions.RayTaskError)
                          else one_line(exc)[:200])
                raise TrainerStartError(f"agent {name!r}: its {len(groups[name])} workers could not join one "
                                        f"process group at {addresses[name]}:{ports[name]} "
                                        f"({reason}); check that the nodes reach each other on that port") from None

    def _fan_out(self, method: Callable, calls: dict[str, tuple], timeout: float | None) -> dict[str, Any]:
        """Fan out to every named agent's workers, then gather; a dead, hung or raising worker is a
        TrainerFailure of its agent. The method's dispatch names the workers (all, or worker 0) and makes
        the agent's answer of theirs (`agent_trainer.dispatch`)."""
        declaration = declaration_of(method)
        dispatch, method_label = declaration.dispatch, declaration.name
        refs = {}  # ref -> (agent, worker rank)
        for name, args in calls.items():
            to_engine = declaration.engine and name in self.engines  # its rollout engine of its own
            # a generate is sent before the lock that synced its engine is let go: an actor runs the calls of one
            # process in the order they were sent, so weights another thread puts into the engine (an evaluation's
            # newest) come after this generate, never between its sync and it
            with self.sync_lock if to_engine else contextlib.nullcontext():
                if to_engine:
                    self._sync_engine(name, args[0].policy_version)
                group = ([self.engines[name]] if to_engine
                         else self.workers[name] if dispatch.all_workers else self.workers[name][:1])
                if len(group) > 1:  # one copy in the object store for all workers
                    args = tuple(ray.put(arg) for arg in args)
                refs.update({actor.call.remote(name, method_label, *args): (name, rank)
                             for rank, actor in enumerate(group)})
        deadline = None if timeout is None else time.monotonic() + timeout
        answers: dict[str, dict[int, Any]] = {name: {} for name in calls}
        pending = list(refs)
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not done:
                name, rank = refs[pending[0]]
                raise self._failure(name, rank, method_label, f"no answer within {timeout:g}s (hung)", True)
            name, rank = refs[done[0]]
            try:
                answers[name][rank] = ray.get(done[0])
            except ray.exceptions.RayActorError as exc:
                self._collect([ref for ref in pending if refs[ref][0] == name])
                shared = [a for a in self.housemates[name] if a != name]
                whose = f" (the host it shares with {', '.join(shared)})" if shared else ""
                raise self._failure(name, rank, method_label, f"its process{whose} died ({one_line(exc)[:200]})",
                                    True) from None
            except ray.exceptions.RayTaskError as exc:
                peers = [ref for ref in pending if refs[ref][0] == name]
                dead = self._dead_peer(peers, refs)  # a peer's death fails this worker's collectives
                if dead is not None:
                    raise self._failure(name, dead, method_label, "its process died (a collective failed on its "
                                        "peers)", True) from None
                raise self._failure(name, rank, method_label, describe(exc.cause or exc), False) from None
        collected = {}
        for name, got in answers.items():
            try:
                collected[name] = dispatch.collect([got[r] for r in sorted(got)])
            except WorkersDisagree as exc:
                raise TrainerFailure(name, method_label, f"its workers disagree: {exc}", recoverable=False) from None
        published = [a for a in collected if a in self.engines]
        if declaration.publishes is Publish.UPDATED:
            self._publish(published, {a: collected[a].policy_version for a in published})
        elif declaration.publishes is Publish.RELOADED:
            self._publish(published)
        return collected

    def _failure(self, agent: str, rank: int, method: str, reason: str, recoverable: bool):
        size = len(self.workers[agent])
        return TrainerFailure(agent, method, f"worker {rank} of {size}: {reason}" if size > 1 else reason, recoverable)

    @staticmethod
    def _collect(peers: list) -> None:
        """Take the answers of a dead worker's peers (their collectives fail with it), waiting a few seconds,
        so that Ray does not print their tracebacks as unhandled errors; what they say is the same death."""
        ready, _ = ray.wait(peers, num_returns=len(peers), timeout=_PEER_GRACE_S) if peers else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError):
                pass

    @staticmethod
    def _dead_peer(peers: list, refs: dict) -> int | None:
        """The rank of a worker among `peers` (refs of one agent's other workers) whose process died, waiting
        a few seconds for Ray to notice a death; None if they all live."""
        ready, _ = ray.wait(peers, num_returns=len(peers), timeout=_PEER_GRACE_S) if peers else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return refs[ref][1]
            except ray.exceptions.RayTaskError:
                pass
        return None

    def info(self, timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Per agent: worker 0's pid, node, device, engine, ... (agents of one host share the pid), with every
        worker's under `workers`; a host that could not start reports its error under each of its agents."""
        hosts = list(self.layout)
        groups = [self.workers[self.layout[h][0]] for h in hosts]
        answers = iter(ray.get([a.info.remote() for group in groups for a in group], timeout=timeout))
        out: dict[str, dict[str, Any]] = {}
        for host, group in zip(hosts, groups):
            per_worker = [next(answers) for _ in group]
            per_worker = [w if "" not in w else dict.fromkeys(self.layout[host], w[""]) for w in per_worker]
            for agent in self.layout[host]:
                out[agent] = {**per_worker[0][agent], "workers": [w[agent] for w in per_worker]}
        actors = {id(a): a for a in self.engines.values()}  # one per host
        answers = dict(zip(actors, ray.get([a.info.remote() for a in actors.values()], timeout=timeout)))
        for agent, actor in self.engines.items():
            answer = answers[id(actor)]
            out[agent]["rollout_engine"] = answer.get(agent, answer.get(""))
        return out

    def close(self) -> None:
        every = [a for group in self.workers.values() for a in group] + list(self.engines.values())
        for actor in {id(a): a for a in every}.values():  # a host's agents share their actors
            ray.kill(actor)
        self.workers.clear()
        self._remove_groups()

    def _remove_groups(self) -> None:
        for group in self.groups:
            remove_placement_group(group)
        self.groups = []


_PEER_GRACE_S = 5.0
"""Seconds a multi-worker agent's call waits, after one worker raised, for Ray to report a peer's death."""


def _node_address(node_id: str) -> str:
    """The IP address of a Ray node, where a worker there can be reached."""
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n.get("NodeID") == node_id)
