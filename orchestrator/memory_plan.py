"""The schedule's memory plan: which agents' optimizer state stays resident at each step, and what each host holds.

An agent updates only at the steps its schedule gives it (`alternate`, `round_robin`, `pattern`; never when in
`schedule.frozen`, and a frozen agent holds no optimizer at all). Between its updates its AdamW state, twice its
trainable weights in float32, is dead weight; with `agents.NAME.optimizer.offload: auto` (the default) the plan
releases it (`agent_trainer.optimizer_offload`) and fetches it back in the background during the step before its
next update. Plain Python: no torch.

- Kept before step s (0-based): the agents that update at one of steps s .. s + L, L being how many steps rollouts
  run ahead (`orchestrator.staleness`, `train.max_staleness`): with rollouts played ahead an update follows the
  previous one with no rollout between them to hide a fetch in, so the fetch starts L steps earlier.
- Offloaded: the trainable agents with `offload: auto` that some step of the schedule's cycle does not keep; an
  agent that updates at every step (`simultaneous`) is never released.
- `MemoryPlan.prepare(pool, s)` runs after the updates of step s - 1 (and once before the first step a run plays, and after a recovery):
  the agents leaving the kept set release, those entering it fetch. Nothing depends on it for correctness: an
  update or a checkpoint finds the real state whatever was released.
"""

from __future__ import annotations

from dataclasses import dataclass
from agent_trainer.agent import Agent
from agent_trainer.handle import TrainerPool
from orchestrator.schedule import Schedule
from protocols.config import RunConfig, agent_resources
from protocols.messages import OptimizerRequest


class MemoryPlan:
    """Which agents hold their optimizer state before each step, for a run's schedule and lag."""

    def __init__(self, config: RunConfig, schedule: Schedule, lag: int):
        self.schedule, self.lag = schedule, lag
        cycle = range(schedule.cycle)
        self.offloaded = [a for a in schedule.trainable if config.agents[a].optimizer.offload == "auto"
                          and any(a not in self.kept(s) for s in cycle)]

    def kept(self, step: int) -> set[str]:
        """The agents that update at one of steps `step` .. `step + lag`: their state is resident before `step`."""
        return {a for s in range(step, step + self.lag + 1) for a in self.schedule.training_agents(s)}

    def calls(self, step: int, *, start: bool = False) -> dict[str, bool]:
        """Before `step`: agent -> keep (True: fetch, False: release), releases first; every offloaded agent
        at a `start`, else those whose place changes since the step before."""
        now = self.kept(step)
        before = set() if start else self.kept(step - 1)
        changed = [a for a in self.offloaded if start or ((a in now) != (a in before))]
        return {a: a in now for a in sorted(changed, key=lambda a: a in now)}

    def prepare(self, pool: TrainerPool, step: int, *, start: bool = False) -> None:
        """Release the optimizer state of the agents the plan does not keep before `step`, and start fetching that
        of the agents it keeps (`start`: the first step a run plays here, every offloaded agent told)."""
        calls = self.calls(step, start=start)
        if calls:
            pool.each(Agent.hold_optimizer, {a: OptimizerRequest(keep=keep) for a, keep in calls.items()})


# ----------------------------------------------------------------------------- `marsi validate`'s table
@dataclass(frozen=True)
class AgentBytes:
    """Estimated bytes of one agent: its weights (an adapter agent: its adapter; the host's base apart), the
    gradients of an update, its optimizer state, its colocated vLLM engine's own copy of the weights (adapter
    agents of one host: the base counted with the first, each agent's adapter with it; an engine of its own,
    `rollout.placement: separate`, is another process: not counted here)."""

    weights: int
    gradients: int
    optimizer: int
    engine: int


def estimate(config: RunConfig, counts: dict[str, tuple[int, int]]) -> tuple[dict[str, AgentBytes], dict[str, int]]:
    """Each agent's `AgentBytes` and each adapter host's shared base, from each agent's model's parameters
    (`counts`: all of them, the trainable ones): float32 master weights, gradients and two AdamW moments for a
    trainable agent (an adapter agent: of its adapter), its dtype for a frozen one, the KL reference and the
    base; `auto` counted as float32 on CPU and bfloat16 on a GPU."""
    sizes, base = {}, {}
    for name, agent in config.agents.items():
        total, trainable = counts[name]
        gpu = agent_resources(config, name).num_gpus > 0
        dtype = agent.dtype if agent.dtype != "auto" else "bfloat16" if gpu else "float32"
        width = 4 if dtype == "float32" else 2
        own_engine = agent.rollout.engine == "vllm" and agent.rollout.placement == "colocated"  # apart: not here
        engine = total * width if own_engine else 0
        trains = name not in config.schedule.frozen
        if agent.adapter is not None:
            host = agent.host or name
            if own_engine:  # the host's one engine: the base once, and each agent's adapter
                engine = trainable * width + (0 if host in base else (total - trainable) * width)
            base[host] = total * width
            own = trainable * 4
            sizes[name] = AgentBytes(weights=own, gradients=own * trains, optimizer=2 * own * trains, engine=engine)
        elif not trains:
            sizes[name] = AgentBytes(weights=total * width, gradients=0, optimizer=0, engine=engine)
        else:
            reference = total * width if config.algorithm.beta > 0 else 0
            sizes[name] = AgentBytes(weights=total * 4 + reference, gradients=total * 4, optimizer=total * 8,
                                     engine=engine)
    return sizes, base


def plan_table(config: RunConfig, layout: dict[str, list[str]], plan: MemoryPlan, sizes: dict[str, AgentBytes],
               base: dict[str, int], *, columns: int = 8) -> list[str]:
    """The lines `marsi validate` prints: per host and per step of the schedule's cycle (at most `columns`), each
    agent's optimizer state (U updates, R resident, - released, F frozen) and the host's estimated bytes at that
    step's peak (weights, the engine's copy, resident optimizer state, gradients during an update); `layout`: host
    -> its agents (`RunPlan.host_layout`); `base`: the bytes of each adapter host's shared base."""
    schedule = plan.schedule
    steps = range(min(schedule.cycle, columns))
    more = f" (first {len(steps)} of {schedule.cycle})" if schedule.cycle > len(steps) else ""
    lines = [f"memory plan, estimated per host at each step of the schedule's {schedule.cycle}-step cycle{more}: "
             "optimizer state U updates, R resident, - released, F frozen (agents.NAME.optimizer.offload)"]
    header = ["host (agents)", "weights", "grads", "optimizer", "engine", *(f"step {s + 1}" for s in steps)]
    rows = []
    for host, agents in layout.items():
        cells = []
        for s in steps:
            kept, training = plan.kept(s), set(schedule.training_agents(s))
            marks = "".join("F" if a in config.schedule.frozen else "U" if a in training else
                            "R" if a in kept or a not in plan.offloaded else "-" for a in agents)
            held = base.get(host, 0) + sum(_at(plan, schedule, sizes, a, s) for a in agents)
            cells.append(f"{marks} {_size(held)}")
        rows.append([f"{host} ({', '.join(agents)})" if agents != [host] else host,
                     _size(base.get(host, 0) + sum(sizes[a].weights for a in agents)),
                     _size(sum(sizes[a].gradients for a in agents)), _size(sum(sizes[a].optimizer for a in agents)),
                     _size(sum(sizes[a].engine for a in agents)), *cells])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    everything = sum(base.values()) + sum(b.weights + b.engine + b.gradients + b.optimizer for b in sizes.values())
    peak = max(sum(_at(plan, schedule, sizes, a, s) for a in sizes) for s in range(schedule.cycle))
    lines.append(f"  all hosts: peak {_size(sum(base.values()) + peak)} with this plan, {_size(everything)} with every "
                 "optimizer resident and every gradient held")
    return lines


def plan_lines(config: RunConfig, layout: dict[str, list[str]], plan: MemoryPlan) -> list[str]:
    """`plan_table` with each agent's model's parameters counted (agent_trainer.model_size.parameter_counts: torch,
    no weights)."""
    from agent_trainer.model_size import parameter_counts

    sizes, base = estimate(config, {name: parameter_counts(agent) for name, agent in config.agents.items()})
    return plan_table(config, layout, plan, sizes, base)


def _at(plan: MemoryPlan, schedule: Schedule, sizes: dict[str, AgentBytes], agent: str, step: int) -> int:
    """Agent `agent`'s bytes at `step`'s peak under the plan (a frozen agent's optimizer and gradients are 0)."""
    b = sizes[agent]
    resident = agent in plan.kept(step) or agent not in plan.offloaded
    return b.weights + b.engine + b.gradients * (agent in schedule.training_agents(step)) + b.optimizer * resident


def _size(n: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B" if n else "0"
