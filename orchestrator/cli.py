"""`marsi run | resume | validate | eval | schema | plot | report | export`."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from orchestrator.checkpoint_files import checkpoint_path
from orchestrator.export import cmd_export
from protocols.config import RunConfig, agent_resources, critic_settings, load_config
from protocols.errors import UserError, one_line


class Parser(argparse.ArgumentParser):
    """Usage errors in one line, as every other error: `marsi: error: marsi eval: ...; see marsi eval --help`."""

    def error(self, message: str):
        print(f"marsi: error: {self.prog}: {one_line(message)}; see {self.prog} --help", file=sys.stderr)
        sys.exit(2)


TAKE_OVER = ("with train.storage: take over the run's lease from a marsi that is gone (no heartbeat for 300 s); a "
             "holder on this machine whose process is gone is taken over without it")


def build_parser() -> argparse.ArgumentParser:
    """The `marsi` argument parser; `--debug` is accepted before or after the subcommand."""
    parser = Parser(prog="marsi", description="Train several LLM agents together with RL.")
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
    p.add_argument("--take-over", action="store_true", help=TAKE_OVER)
    p = sub.add_parser("resume", parents=[common], help="continue a run from its newest checkpoint")
    p.add_argument("run_dir", help="the run directory to continue, or the run's place in train.storage "
                   "(STORAGE/RUN_NAME), which holds the whole run")
    p.add_argument("overrides", nargs="*", help="change the stored config, e.g. train.steps=400 to extend the run")
    p.add_argument("--run-dir", dest="fetch_to", help="with a place in storage: the (new or empty) run directory to "
                   "fetch the run into and go on in (default: runs/RUN_NAME)")
    p.add_argument("--take-over", action="store_true", help=TAKE_OVER)
    p = sub.add_parser("validate", parents=[common],
                       help="check a config; print the schedule and role assignment of the first steps")
    p.add_argument("config", help="the YAML config file to check")
    p.add_argument("overrides", nargs="*", help="dotted.key=value applied on top of the file, e.g. train.steps=5")
    p.add_argument("--steps", type=int, default=6, help="how many steps to print (default: 6)")
    sub.add_parser("schema", parents=[common], help="print the config's JSON schema")
    for name, what, out in (
            ("plot", "write PNG curves of runs, overlaid (plot.png, reward.png)",
             "directory for the PNG files (default: the first run directory)"),
            ("report", "write one self-contained HTML report of runs: curves, evaluations, episodes, config",
             "the HTML file to write (default: report.html in the first run directory)")):
        p = sub.add_parser(name, parents=[common], help=what)
        p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or runs' places in "
                       "train.storage, STORAGE/RUN_NAME), overlaid in the curves")
        p.add_argument("--out", help=out)
        if name == "report":
            p.add_argument("--force", action="store_true", help="let --out replace a file that is not a report marsi "
                           "wrote (a run's record, say)")
        p.add_argument("--smoothing", type=_smoothing, default=None,
                       help="weight of the moving average drawn over the raw reward, in [0, 1) (default: 0.6)")
        if name == "report":
            p.add_argument("--max-mb", type=_megabytes, default=None,
                           help="at most this many MB of episodes inlined (the most recent and a spread of the older "
                           "ones; the rest are counted on the page) (default: 20)")
    p = sub.add_parser("eval", parents=[common],
                       help="evaluate a run's checkpoints (or a config's initial models) on the eval set")
    p.add_argument("target", help="a run directory (or the run's place in train.storage, STORAGE/RUN_NAME), or a "
                   "config file (its initial models)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value over the stored config, e.g. eval.episodes_per_sample=4")
    p.add_argument("--checkpoint", default=None, help="initial | last | all | step-N (default: last; initial for a config)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="evaluate A and B (initial, last, step-N) and print "
                   "B - A with a 95%% confidence interval")
    p.add_argument("--metric", default="reward/mean", help="what --compare compares, per episode: reward/mean (default) "
                   "or episode/KEY (e.g. episode/win in a zero-sum game)")
    p = sub.add_parser("export", parents=[common],
                       help="write one agent of a run as a Hugging Face model (an adapter merged into its base)")
    p.add_argument("run_dir", help="the run directory, or the run's place in train.storage (STORAGE/RUN_NAME)")
    p.add_argument("--agent", required=True, help="the agent to export")
    p.add_argument("--out", required=True, help="a new (or empty) directory for the model")
    p.add_argument("--checkpoint", default="last", help="last (default) | step-N")
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
    except BrokenPipeError:  # the reader went away (marsi schema | head): end quietly, as a pipe's writer does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt as exc:
        print(f"marsi: {exc}" if isinstance(exc, Interrupted) else "marsi: interrupted", file=sys.stderr)
        return 128 + getattr(exc, "signum", signal.SIGINT)
    except Exception as exc:
        if args.debug:
            raise
        print(f"marsi: error: {one_line(exc) or type(exc).__name__}", file=sys.stderr)
        return 2 if isinstance(exc, (UserError, FileNotFoundError)) else 1


def cmd_run(args) -> int:
    from orchestrator.coordinator import Coordinator
    from orchestrator.preflight import check_cluster, storage_place_problem
    from orchestrator.runlog import make_run_dir
    from protocols.config import ConfigError, joins_cluster
    from protocols.plan import plan_of

    config = load_config(args.config, args.overrides)
    stamp = time.strftime("%Y%m%d-%H%M%S")  # as make_run_dir names it
    planned = Path(args.run_dir or config.train.run_dir.format(name=Path(args.config).stem, time=stamp))
    problem = storage_place_problem(config.train.storage, planned)
    if problem:
        raise ConfigError(f"{args.config}: {problem}")
    if not joins_cluster(config.ray):  # a cluster marsi joins is checked once joined
        check_cluster(config, plan_of(config), args.config)
    with StopOnSignal("nothing was trained and no run directory is left") as stop:
        run_dir = Path(args.run_dir) if args.run_dir else make_run_dir(config.train.run_dir, Path(args.config).stem)
        try:
            coord = Coordinator(config, run_dir, take_over=args.take_over)
        except BaseException:
            if not args.run_dir:
                with contextlib.suppress(OSError):
                    run_dir.rmdir()  # made just now for this run, which did not start
            raise
        return _train(coord, stop, new=True)


def cmd_resume(args) -> int:
    from orchestrator import runstore
    from orchestrator.coordinator import Coordinator
    from orchestrator.resume import check_resume
    from orchestrator.runlog import RunLog

    if args.fetch_to and not runstore.is_place(args.run_dir):
        raise UserError(f"--run-dir {args.fetch_to}: only with a run's place in storage; {args.run_dir} is a run directory")
    with StopOnSignal(f"the run is as it was; continue with: marsi resume {args.run_dir}") as stop:
        # a run's place in the store: fetched into a run directory (brought up to the store where it is one already);
        # a resume refused or stopped before it starts leaves no directory it fetched
        with runstore.resumable(args.run_dir, args.fetch_to, take_over=args.take_over) as (run_dir, checkpoint):
            if checkpoint is not None:
                print(f"marsi: fetched the run at {runstore.as_place(args.run_dir)} ({checkpoint.name}) into {run_dir}",
                      file=sys.stderr)
            stored = run_dir / "config.yaml"
            config, log = load_config(stored, args.overrides), RunLog(run_dir)
            check_resume(config, load_config(stored, check_imports=False), log)
            if log.steps_done() == config.train.steps:
                print(f"marsi: {run_dir} has done all its {config.train.steps} steps; to go on, give more: "
                      f"marsi resume {run_dir} train.steps=N", file=sys.stderr)
                return 0
            coord = Coordinator.resume(run_dir, args.overrides, take_over=args.take_over)
        print(f"marsi: resuming {run_dir} at step {coord.state.step}", file=sys.stderr)
        return _train(coord, stop, new=False)


class Interrupted(KeyboardInterrupt):
    """A signal that stopped `marsi run` or `resume` while it started, before there was anything to save."""

    def __init__(self, signum: int, outcome: str):
        super().__init__(f"{signal.Signals(signum).name}: stopped while starting; {outcome}")
        self.signum = signum


class StopOnSignal:
    """marsi's handling of SIGINT and SIGTERM for a run, in place before Ray starts (whose driver would
    otherwise take SIGTERM itself: an exit without a word, or a stack dump). While the run starts, a signal
    stops it at once (`Interrupted`, saying `outcome`); once `coord` is set, it asks the coordinator to stop
    after the current step with a checkpoint, and a second Ctrl-C aborts."""

    def __init__(self, outcome: str):
        self.outcome, self.coord, self.signals, self.stopped_by = outcome, None, [], None

    def __enter__(self) -> StopOnSignal:
        self.previous = {s: signal.signal(s, self.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, kind, exc, tb) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.stopped_by is not None and isinstance(exc, KeyboardInterrupt) and not isinstance(exc, Interrupted):
            raise Interrupted(self.stopped_by, self.outcome) from None  # Ray's waits raise a plain one in its place

    def on_signal(self, signum, frame) -> None:
        if self.coord is None:
            self.stopped_by = signum
            raise Interrupted(signum, self.outcome)
        if self.signals and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signals.append(signum)
        self.coord.request_stop()
        print(f"marsi: {signal.Signals(signum).name}: stopping after this step with a checkpoint"
              " (Ctrl-C again aborts)", file=sys.stderr, flush=True)


def _train(coord, stop: StopOnSignal, new: bool) -> int:
    """Start a new run's coordinator, then train; a new run that fails before its first step leaves no directory."""
    began = time.perf_counter()
    if new:
        coord.start()  # a start that fails leaves no directory (Coordinator.start)
    try:
        first = coord.state.step
        stop.coord = coord
        coord.run()
    except BaseException:
        if new:
            coord.log.discard_unstarted()
        raise
    finally:
        coord.close()
    rows = [r for r in coord.log.metrics() if "reward/mean" in r]  # training rows (evaluation rows aside)
    if stop.signals:
        print(f"marsi: stopped at step {coord.state.step}; continue with: marsi resume {coord.log.dir}", file=sys.stderr)
        return 128 + stop.signals[0]
    k = max(1, len(rows) // 10)
    first_reward = sum(r["reward/mean"] for r in rows[:k]) / k
    last_reward = sum(r["reward/mean"] for r in rows[-k:]) / k
    this_time = f" ({coord.state.step - first} this time)" if first else ""
    print(f"reward/mean: first {k} step(s) {first_reward:.3f} -> last {k} step(s) {last_reward:.3f}; "
          f"{len(rows)} steps{this_time}, {time.perf_counter() - began:.0f} s here; run dir {coord.log.dir}")
    return 0


def _member_label(config, name: str) -> str:
    """How `marsi validate` names an agent or critic in its host's line."""
    if name not in config.agents:
        model = critic_settings(config).model
        return f"{name} (critic, {'a head on the agent' if model == 'agent' else model})"
    adapter = config.agents[name].adapter
    return f"{name} (adapter r={adapter.rank})" if adapter else name


def cmd_validate(args) -> int:
    """Everything that can be checked without the weights: config, environment roles and seats, each model's
    context, resources (against the Ray cluster marsi would join, where there is one: custom resources, GPU types,
    node labels), each agent's dtype as this machine would resolve it, the memory plan (whose optimizer state is
    resident at each step of the schedule's cycle, and the estimated bytes); then the schedule and who acts on
    each turn for the first steps."""
    from agent_trainer.group import local_resources
    from agent_trainer.models import context_problem, model_config
    from orchestrator import memory_plan
    from orchestrator.coordinator import Coordinator
    from orchestrator.preflight import check_cluster, checked_trial, storage_place_problem
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
    check_cluster(config, coordinator.plan, args.config)
    planned = Path(config.train.run_dir.format(name=Path(args.config).stem, time="{time}"))
    problem = storage_place_problem(config.train.storage, planned)
    if problem:
        raise ConfigError(f"{args.config}: {problem}")
    schedule, assignment = Schedule(config.schedule, list(config.agents)), RoleAssignment(config.roles)
    per_step = config.train.batch_size * config.train.num_generations
    trial = checked_trial(coordinator.make_env, coordinator.samples[0], config.train.seed, config.roles.attempts)
    acting = {t: {a.role for a in turn.actions} for t, turn in enumerate(trial.turns)}
    print(f"{args.config}: valid. agents: {', '.join(config.agents)}; roles: {', '.join(env.possible_agents)}; "
          f"{per_step} episodes per step, at most {env.max_turns} turns each")
    layout = coordinator.plan.member_layout  # the agents' hosts and the critics'
    asked = list(coordinator.plan.host_resources.values())
    where = f"the Ray cluster at {joins} can place them" if joins else (
        "in-process (ray.enabled false)" if not config.ray.enabled else
        "local cluster: {:g} CPUs, {:g} GPUs".format(*local_resources(config)))
    print(f"resources: trainers ask for {sum(r.num_cpus * r.num_workers for r in asked):g} CPUs, "
          f"{sum(r.num_gpus * r.num_workers for r in asked):g} GPUs; {where}")
    for (host, names), r in zip(layout.items(), asked):
        agents = [_member_label(config, n) for n in names]
        plain = [n for n in names if n in config.agents]
        shared = f", one copy of {config.agents[plain[0]].model}" if len(plain) > 1 else ""
        workers = f" per worker x {r.num_workers} workers" if r.num_workers > 1 else ""
        print(f"host {host}: {', '.join(agents)}; {r.num_cpus:g} CPUs, {r.num_gpus:g} GPUs{workers}{shared}")
    for host, names in coordinator.plan.engine_layout.items():  # rollout.placement: separate
        r = coordinator.plan.engine_resources[host]
        shared = f", one copy of {config.agents[names[0]].model} and {len(names)} adapters" if len(names) > 1 else ""
        print(f"rollout engine apart, host {host}: {', '.join(names)}; {r.num_cpus:g} CPUs, {r.num_gpus:g} GPUs"
              f"{shared}")
    _print_precision(config, joins)
    if not schedule.trainable:
        print("no agent trains (all are in schedule.frozen): the run plays episodes and logs their rewards only")
    trains = {a for step in range(min(config.train.steps, 10_000)) for a in schedule.training_agents(step)}
    frozen = [a for a in config.agents if a not in trains]
    if frozen:
        unused = [f"agents.{a}.optimizer" for a in frozen if "optimizer" in config.agents[a].model_fields_set]
        print(f"frozen, never updated in this run: {', '.join(frozen)}" +
              (f"; {', '.join(unused)} set but unused" if unused else ""))
    if coordinator.lag:
        apart = [a for a, spec in config.agents.items() if spec.rollout.placement == "separate"]
        print(f"asynchronous rollouts: train.max_staleness {config.train.max_staleness}; each step's episodes are "
              f"played {coordinator.lag} step(s) ahead, while earlier steps update; rollout engines of their own: "
              f"{', '.join(apart) or 'none'}")
    if coordinator.lag_note:
        print(f"rollouts: {coordinator.lag_note}")
    print("\n".join(memory_plan.plan_lines(config, coordinator.plan.host_layout, coordinator.memory)))
    tries = {role: f" x{k}" for role, k in coordinator.attempts.items()}
    marks = ", xK the roles that answer each prompt K times" if tries else ""
    print("steps count from 1, as in metrics.jsonl; turns of a trial episode on the first sample "
          f"(* marks the roles that acted{marks})")
    for step in range(min(args.steps, config.train.steps)):
        print(f"step {step + 1}: trains {', '.join(schedule.training_agents(step)) or '(none)'}")
        for episode in range(step * per_step, min(step * per_step + 2, (step + 1) * per_step)):
            turns = " | ".join(f"turn {t + 1}: " + " ".join(
                f"{r}={a}{'*' if r in acting.get(t, ()) else ''}{tries.get(r, '')}"
                for r, a in assignment(episode, t).items()) for t in range(env.max_turns))
            print(f"  episode {episode + 1}: {turns}")
    return 0


def _print_precision(config, joins: str | None) -> None:
    """Each agent's compute dtype and why, resolved as its trainer would on this machine. Trainers resolve on
    their own device when the run starts: the same unless they run on another node or a GPU this machine lacks."""
    import torch

    from agent_trainer.precision import MEASURED, capabilities, describe, native_bf16, resolve

    here = {kind: capabilities(kind) for kind in ("cpu", "cuda") if kind == "cpu" or torch.cuda.is_available()}
    cells = []
    for name, agent in config.agents.items():
        caps = here.get("cuda" if agent_resources(config, name).num_gpus > 0 else "cpu")
        if caps is None:
            cells.append(f"{name}: {agent.dtype} (decided on the trainer's GPU at start; this machine has none)")
            continue
        dtype, reason = resolve(agent.dtype, caps, model=agent.model)
        if dtype == MEASURED:
            dtype, reason = "bfloat16 or float32", f"{reason}; the faster on this model, measured when the trainer starts"
        elif dtype == "bfloat16" and native_bf16(caps) is None:
            reason += "; emulated here, often several times slower than float32: auto or float32 fits"
        cells.append(f"{name}: {dtype} ({reason})")
    elsewhere = "; trainers on other nodes decide on theirs at start" if joins else ""
    print(f"precision on this machine, {' and '.join(describe(c) for c in here.values())}{elsewhere}: "
          + "; ".join(cells))


def cmd_eval(args) -> int:
    """Evaluate checkpoints of a run (or a config's initial models); a run directory gets eval.jsonl rows (a run
    with train.storage: STORAGE/RUN_NAME/eval.jsonl too)."""
    from orchestrator import runstore

    with runstore.run_view(args.target) as target:
        return _eval(args, target)


def _eval(args, target: Path) -> int:
    from orchestrator import runstore
    from orchestrator.coordinator import Coordinator
    from orchestrator.evaluation import compare
    from orchestrator.preflight import evaluated_run_problem
    from orchestrator.checkpoint_files import CheckpointName
    from orchestrator.runlog import RunLog
    from protocols.config import ConfigError

    is_run = target.is_dir()
    problem = evaluated_run_problem(target) if is_run else None
    if problem:
        raise ConfigError(problem)
    config = load_config(target / "config.yaml" if is_run else target, args.overrides + ["train.progress=false"])
    if config.eval is None:
        raise ConfigError(f"{args.target}: the config has no eval: section; add one (or eval.data.path=... as an override)")
    log = RunLog(target) if is_run else None
    names = args.compare or _checkpoint_names(args.checkpoint or ("last" if is_run else "initial"), log)
    if not is_run and set(names) != {"initial"}:
        raise ConfigError(f"{args.target}: a config has only initial models to evaluate; give a run directory for checkpoints")
    coord = Coordinator(config)
    if args.compare:
        _check_metric(args.metric, coord.evaluation)
    for name in set(names) - {"initial"}:
        checkpoint_path(name, log)  # each is there before anything starts
    results, labels = {}, {}
    with coord:
        for name in sorted(names, key=lambda n: n != "initial"):  # initial first: the trainers start there
            step = 0
            if name != "initial":
                path = checkpoint_path(name, log)  # `last` resolves now: a run may still be adding checkpoints
                coord.load_weights(path)
                step = CheckpointName.of(path).step
            result = coord.evaluation.run(coord.generate, coord.assignment, initial=name == "initial")
            results[name], labels[name] = result, name if name != "last" else f"last (step {step})"
            if log is not None:
                row = {"checkpoint": name, "step": step, "time": time.time(), **result.metrics, "episodes": result.episodes}
                log.log_eval(row)
                runstore.append_eval_rows(log, [row])
    _print_eval_table({labels[name]: result for name, result in results.items()})
    if args.compare:
        first, second = results[args.compare[0]], results[args.compare[1]]
        a, b = labels[args.compare[0]], labels[args.compare[1]]
        if args.metric not in first.episodes[""]:
            raise ConfigError(f"--metric {args.metric}: not reported by every episode; have "
                              f"{', '.join(first.episodes[''])}")
        for label in first.episodes:  # as trained, then each partner setting against itself
            c = compare(first.episodes[label][args.metric], second.episodes[label][args.metric], first.samples)
            verdict = "distinguishable from noise" if c["distinguishable"] else "NOT distinguishable from noise"
            print(f"{label + ': ' if label else ''}{args.metric} {b} - {a}: {c['difference']:+.4f} (95% CI "
                  f"{c['low']:+.4f} .. {c['high']:+.4f} over {c['samples']} samples; {a} {c['before']:.4f}, {b} "
                  f"{c['after']:.4f}; {c['episodes']} paired episodes, temperature {config.eval.temperature:g}): {verdict}")
    return 0


def _check_metric(metric: str, evaluation) -> None:
    """Refuse, before any evaluation runs, a --metric that is neither reward/mean nor episode/KEY for a KEY that
    the environment's episode_info reports (seen in a trial episode on the first evaluation sample)."""
    from orchestrator.preflight import trial_episode
    from protocols.config import ConfigError

    if metric == "reward/mean":
        return
    info = trial_episode(evaluation.make_env, evaluation.samples[0], evaluation.seed, evaluation.attempts).info
    have = ", ".join(["reward/mean", *(f"episode/{k}" for k in sorted(info))])
    if not metric.startswith("episode/"):
        raise ConfigError(f"--metric {metric}: give reward/mean or episode/KEY; this environment reports {have}")
    key = metric.removeprefix("episode/")
    if key not in info:
        raise ConfigError(f"--metric {metric}: the environment's episode_info has no {key!r}; give one of {have}")


def _checkpoint_names(which: str, log) -> list[str]:
    if which == "all":
        return ["initial"] + ([p.name for p in log.checkpoints()] if log else [])
    return [which]


def _print_eval_table(results) -> None:
    """One row per checkpoint and setting (as trained, then each partner label), each metric as mean ± its 95%
    confidence half-width (1.96 standard errors, as the report shows it), said under the table."""
    from orchestrator.plot import CONFIDENCE

    rows = []
    for name, result in results.items():
        for label in result.episodes:
            prefix = f"eval/{label}/" if label else "eval/"
            metrics = {k.removeprefix(prefix): v for k, v in result.metrics.items()
                       if k.startswith(prefix) and (label or not _partner_key(k, result))}
            rows.append((f"{name} {label}".strip(), metrics))
    keys = sorted({k for _, m in rows for k in m if not k.endswith(("/stderr", "episodes"))})
    print(f"{'evaluation':28s} {'episodes':>8s}  " + "  ".join(f"{k:>20s}" for k in keys))
    for title, m in rows:
        cells = [f"{m[k]:.3f} ± {CONFIDENCE * m.get(k + '/stderr', 0.0):.3f}" if k in m else "-" for k in keys]
        print(f"{title:28s} {int(m.get('episodes', 0)):8d}  " + "  ".join(f"{c:>20s}" for c in cells))
    print(f"mean ± 95% confidence ({CONFIDENCE} standard errors, clustered per held-out sample: docs/evaluation.md)")


def _partner_key(key: str, result) -> bool:
    return any(label and key.startswith(f"eval/{label}/") for label in result.episodes)


def cmd_schema(args) -> int:
    print(json.dumps(RunConfig.model_json_schema(), indent=2))
    return 0


def _smoothing(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text}: give a weight in [0, 1), e.g. 0.6 (0: no smoothing)")
    return value


def _megabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text}: give a size in MB above 0, e.g. 50")
    return value


def cmd_plot(args) -> int:
    from orchestrator.plot import SMOOTHING, plot

    with _run_views(args.run_dirs) as run_dirs:
        out = args.out or (None if run_dirs[0] == Path(args.run_dirs[0]) else ".")  # a place in storage: here
        for path in plot(run_dirs, out, SMOOTHING if args.smoothing is None else args.smoothing):
            print(path)
    return 0


@contextlib.contextmanager
def _run_views(targets: list[str]):
    """Run directories for `targets`: themselves, or temporary ones fetched from runs' places in storage."""
    from orchestrator import runstore

    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(runstore.run_view(t)) for t in targets]


def cmd_report(args) -> int:
    from orchestrator.plot import SMOOTHING
    from orchestrator.report import report
    from orchestrator.runfiles import check_output
    from orchestrator.transcripts import MAX_MB

    if args.out:
        check_output(Path(args.out), force=args.force)  # before a run is fetched from its store
    with _run_views(args.run_dirs) as run_dirs:
        out = args.out or (None if run_dirs[0] == Path(args.run_dirs[0]) else "report.html")  # a place in storage: here
        print(report(run_dirs, out, SMOOTHING if args.smoothing is None else args.smoothing,
                     MAX_MB if args.max_mb is None else args.max_mb, force=args.force))
    return 0


COMMANDS = {"run": cmd_run, "resume": cmd_resume, "validate": cmd_validate, "eval": cmd_eval, "schema": cmd_schema,
            "plot": cmd_plot, "report": cmd_report, "export": cmd_export}

if __name__ == "__main__":
    sys.exit(main())
