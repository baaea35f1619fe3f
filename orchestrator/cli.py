"""`marsi run | resume | validate | schema | plot`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from protocols.config import RunConfig, load_config
from protocols.errors import UserError, one_line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="marsi", description="Train several LLM agents together with RL.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="train from a config")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, e.g. train.steps=5")
    p.add_argument("--run-dir", help="run directory (default: train.run_dir)")
    p = sub.add_parser("resume", help="continue a run from its newest checkpoint")
    p.add_argument("run_dir")
    p.add_argument("overrides", nargs="*", help="change the stored config, e.g. train.steps=400 to extend the run")
    p = sub.add_parser("validate", help="check a config; print the schedule and role assignment of the first steps")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=6)
    sub.add_parser("schema", help="print the config's JSON schema")
    p = sub.add_parser("plot", help="write PNG curves of a run")
    p.add_argument("run_dir")
    args, rest = parser.parse_known_args(argv)
    if rest and hasattr(args, "overrides") and all("=" in r and not r.startswith("-") for r in rest):
        args.overrides += rest  # overrides given after options
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("marsi: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"marsi: error: {one_line(exc) or type(exc).__name__}", file=sys.stderr)
        return 2 if isinstance(exc, (UserError, FileNotFoundError)) else 1


def cmd_run(args) -> int:
    from orchestrator.coordinator import Coordinator
    from orchestrator.runlog import make_run_dir

    config = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else make_run_dir(config.train.run_dir, Path(args.config).stem)
    return _train(Coordinator(config, run_dir), started=False)


def cmd_resume(args) -> int:
    from orchestrator.coordinator import Coordinator, check_resume
    from orchestrator.runlog import RunLog

    stored = Path(args.run_dir) / "config.yaml"
    config, log = load_config(stored, args.overrides), RunLog(args.run_dir)
    check_resume(config, load_config(stored, check_imports=False), log)
    if log.steps_done() == config.train.steps:
        print(f"marsi: {args.run_dir} has done all its {config.train.steps} steps; to go on, give more: "
              f"marsi resume {args.run_dir} train.steps=N", file=sys.stderr)
        return 0
    coord = Coordinator.resume(args.run_dir, args.overrides)
    print(f"marsi: resuming {args.run_dir} at step {coord.state.step}", file=sys.stderr)
    return _train(coord, started=True)


def _train(coord, started: bool) -> int:
    start, signals = time.perf_counter(), []

    def on_signal(signum, frame):
        if signals and signum == signal.SIGINT:
            raise KeyboardInterrupt
        signals.append(signum)
        coord.request_stop()
        print(f"marsi: {signal.Signals(signum).name}: stopping after this step with a checkpoint"
              " (Ctrl-C again aborts)", file=sys.stderr, flush=True)

    if not started:
        coord.start()  # before the handlers: starting Ray installs its own SIGTERM handler
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        coord.run()
    except BaseException:
        if not started:
            coord.log.discard_unstarted()  # a run that failed before its first step leaves no directory
        raise
    finally:
        coord.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    rows = coord.log.metrics()
    if signals:
        print(f"marsi: stopped at step {coord.state.step}; continue with: marsi resume {coord.log.dir}", file=sys.stderr)
        return 128 + signals[0]
    k = max(1, len(rows) // 10)
    first = sum(r["reward/mean"] for r in rows[:k]) / k
    last = sum(r["reward/mean"] for r in rows[-k:]) / k
    print(f"reward/mean: first {k} step(s) {first:.3f} -> last {k} step(s) {last:.3f}; "
          f"{len(rows)} steps, {time.perf_counter() - start:.0f} s here; run dir {coord.log.dir}")
    return 0


def cmd_validate(args) -> int:
    """Everything that can be checked without Ray or the weights: config, environment roles and seats,
    each model's context, resources; then the schedule and who acts on each turn for the first steps."""
    from agent_trainer.group import local_resources, placement_problem
    from agent_trainer.models import context_problem, model_config
    from orchestrator.coordinator import Coordinator
    from orchestrator.schedule import RoleAssignment, Schedule
    from protocols.config import ConfigError

    config = load_config(args.config, args.overrides)
    coordinator = Coordinator(config)  # constructs the environment and checks its roles against the seats
    env = coordinator.make_env()
    for name, agent in config.agents.items():
        gen = agent.generation
        problem = context_problem(model_config(agent.model), gen.max_prompt_length, gen.max_completion_length)
        if problem:
            raise ConfigError(f"{args.config}: agents.{name}: {problem}")
    joins = config.ray.address or os.environ.get("RAY_ADDRESS")
    if config.ray.enabled and not joins:
        cpus, gpus = local_resources(config)
        problem = placement_problem(config, cpus, gpus, "the local cluster")
        if problem:
            raise ConfigError(f"{args.config}: {problem}")
    schedule, assignment = Schedule(config.schedule, list(config.agents)), RoleAssignment(config.roles)
    per_step = config.train.batch_size * config.train.num_generations
    acting = _acting_roles(coordinator, env)
    print(f"{args.config}: valid. agents: {', '.join(config.agents)}; roles: {', '.join(env.possible_agents)}; "
          f"{per_step} episodes per step, at most {env.max_turns} turns each")
    asked = sum(a.resources.num_cpus for a in config.agents.values())
    where = f"joins {joins}; checked when the run starts" if joins else (
        "in-process (ray.enabled false)" if not config.ray.enabled else
        "local cluster: {:g} CPUs, {:g} GPUs".format(*local_resources(config)))
    print(f"resources: trainers ask for {asked:g} CPUs, "
          f"{sum(a.resources.num_gpus for a in config.agents.values()):g} GPUs; {where}")
    if not schedule.trainable:
        print("no agent trains (all are in schedule.frozen): the run plays episodes and logs their rewards only")
    print("steps count from 1, as in metrics.jsonl; turns of a trial episode on the first sample "
          "(* marks the roles that acted)")
    for step in range(min(args.steps, config.train.steps)):
        print(f"step {step + 1}: trains {', '.join(schedule.training_agents(step)) or '(none)'}")
        for episode in range(step * per_step, min(step * per_step + 2, (step + 1) * per_step)):
            turns = " | ".join(f"turn {t + 1}: " + " ".join(
                f"{r}={a}{'*' if r in acting.get(t, ()) else ''}" for r, a in assignment(episode, t).items())
                for t in range(env.max_turns))
            print(f"  episode {episode + 1}: {turns}")
    return 0


def _acting_roles(coordinator, env) -> dict[int, set[str]]:
    """Roles that act on each turn of one episode of the first sample, played with the environment module's
    `sample_action(role, prompt, rng)` when it has one, else empty answers."""
    import random

    from orchestrator.rollout import derive_seed

    module = sys.modules.get(type(env).__module__)
    act = getattr(module, "sample_action", None) or (lambda role, prompt, rng: "")
    rng, acting = random.Random(0), {}
    prompts = env.reset(dict(coordinator.samples[0]), seed=derive_seed(coordinator.config.train.seed, 0))
    for turn in range(env.max_turns):
        if not prompts:
            break
        acting[turn] = set(prompts)
        result = env.step({role: act(role, prompt, rng) for role, prompt in prompts.items()})
        if result.terminated or result.truncated:
            break
        prompts = result.prompts
    return acting


def cmd_schema(args) -> int:
    print(json.dumps(RunConfig.model_json_schema(), indent=2))
    return 0


def cmd_plot(args) -> int:
    from orchestrator.runlog import plot

    for path in plot(args.run_dir):
        print(path)
    return 0


COMMANDS = {"run": cmd_run, "resume": cmd_resume, "validate": cmd_validate, "schema": cmd_schema, "plot": cmd_plot}

if __name__ == "__main__":
    sys.exit(main())
