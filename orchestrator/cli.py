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


def build_parser() -> argparse.ArgumentParser:
    """The `marsi` argument parser; `--debug` is accepted before or after the subcommand."""
    parser = argparse.ArgumentParser(prog="marsi", description="Train several LLM agents together with RL.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common = argparse.ArgumentParser(add_help=False)  # default SUPPRESS: absent here keeps the value given before
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do; marsi COMMAND --help lists its arguments")
    p = sub.add_parser("run", parents=[common], help="train from a config")
    p.add_argument("config", help="the run's YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted.key=value applied on top of the file, e.g. train.steps=5")
    p.add_argument("--run-dir", help="run directory (default: train.run_dir)")
    p = sub.add_parser("resume", parents=[common], help="continue a run from its newest checkpoint")
    p.add_argument("run_dir", help="the run directory to continue")
    p.add_argument("overrides", nargs="*", help="change the stored config, e.g. train.steps=400 to extend the run")
    p = sub.add_parser("validate", parents=[common],
                       help="check a config; print the schedule and role assignment of the first steps")
    p.add_argument("config", help="the YAML config file to check")
    p.add_argument("overrides", nargs="*", help="dotted.key=value applied on top of the file, e.g. train.steps=5")
    p.add_argument("--steps", type=int, default=6, help="how many steps to print (default: 6)")
    sub.add_parser("schema", parents=[common], help="print the config's JSON schema")
    p = sub.add_parser("plot", parents=[common], help="write PNG curves of a run (plot.png, reward.png, loss.png)")
    p.add_argument("run_dir", help="the run directory whose metrics.jsonl to plot")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
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
    from orchestrator.schedule import RoleAssignment, Schedule
    from protocols.imports import import_object

    config = load_config(args.config, args.overrides)
    schedule, assignment = Schedule(config.schedule, list(config.agents)), RoleAssignment(config.roles)
    env = import_object(config.environment.name)(**config.environment.kwargs)
    per_step = config.train.batch_size * config.train.num_generations
    turns = min(env.max_turns, 4)
    print(f"{args.config}: valid. agents: {', '.join(config.agents)}; roles: {', '.join(env.possible_agents)}; "
          f"{per_step} episodes per step, at most {env.max_turns} turns each")
    for step in range(min(args.steps, config.train.steps)):
        trains = ", ".join(schedule.training_agents(step)) or "(none)"
        print(f"step {step}: trains {trains}")
        for episode in sorted({step * per_step, step * per_step + 1} & set(range(step * per_step, (step + 1) * per_step))):
            seats = " | ".join(" ".join(f"{r}={a}" for r, a in assignment(episode, t).items()) for t in range(turns))
            print(f"  episode {episode} turns 0..{turns - 1}: {seats}")
    return 0


def cmd_schema(args) -> int:
    print(json.dumps(RunConfig.model_json_schema(), indent=2))
    return 0


def cmd_plot(args) -> int:
    from orchestrator.plot import plot

    for path in plot(args.run_dir):
        print(path)
    return 0


COMMANDS = {"run": cmd_run, "resume": cmd_resume, "validate": cmd_validate, "schema": cmd_schema, "plot": cmd_plot}

if __name__ == "__main__":
    sys.exit(main())
