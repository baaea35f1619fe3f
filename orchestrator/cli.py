"""`marsi run | resume | validate | eval | schema | plot | export`."""

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
    p = sub.add_parser("eval", parents=[common],
                       help="evaluate a run's checkpoints (or a config's initial models) on the eval set")
    p.add_argument("target", help="a run directory, or a config file (its initial models)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value over the stored config, e.g. eval.episodes_per_sample=4")
    p.add_argument("--checkpoint", default=None, help="initial | last | all | step-N (default: last; initial for a config)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="evaluate A and B (initial, last, step-N) and print "
                   "B - A with a 95%% confidence interval")
    p.add_argument("--metric", default="reward/mean", help="what --compare compares, per episode: reward/mean (default) "
                   "or episode/KEY (e.g. episode/win in a zero-sum game)")
    p = sub.add_parser("export", parents=[common],
                       help="write one agent of a run as a Hugging Face model (an adapter merged into its base)")
    p.add_argument("run_dir", help="the run directory")
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
    rows = [r for r in coord.log.metrics() if "reward/mean" in r]  # training rows (evaluation rows aside)
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
    each model's context, resources, each agent's dtype as this machine would resolve it; then the schedule
    and who acts on each turn for the first steps."""
    from agent_trainer.group import local_resources, placement_problem
    from agent_trainer.models import context_problem, model_config
    from orchestrator.coordinator import Coordinator
    from orchestrator.schedule import RoleAssignment, Schedule
    from protocols.config import ConfigError, host_layout

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
    layout = host_layout(config)
    asked = [config.agents[names[0]].resources for names in layout.values()]
    where = f"joins {joins}; checked when the run starts" if joins else (
        "in-process (ray.enabled false)" if not config.ray.enabled else
        "local cluster: {:g} CPUs, {:g} GPUs".format(*local_resources(config)))
    print(f"resources: trainers ask for {sum(r.num_cpus * r.num_workers for r in asked):g} CPUs, "
          f"{sum(r.num_gpus * r.num_workers for r in asked):g} GPUs; {where}")
    for (host, names), r in zip(layout.items(), asked):
        agents = [f"{n} (adapter r={config.agents[n].adapter.rank})" if config.agents[n].adapter else n for n in names]
        shared = f", one copy of {config.agents[names[0]].model}" if len(names) > 1 else ""
        workers = f" per worker x {r.num_workers} workers" if r.num_workers > 1 else ""
        print(f"host {host}: {', '.join(agents)}; {r.num_cpus:g} CPUs, {r.num_gpus:g} GPUs{workers}{shared}")
    _print_precision(config, joins)
    if not schedule.trainable:
        print("no agent trains (all are in schedule.frozen): the run plays episodes and logs their rewards only")
    trains = {a for step in range(min(config.train.steps, 10_000)) for a in schedule.training_agents(step)}
    frozen = [a for a in config.agents if a not in trains]
    if frozen:
        unused = [f"agents.{a}.optimizer" for a in frozen if "optimizer" in config.agents[a].model_fields_set]
        print(f"frozen, never updated in this run: {', '.join(frozen)}" +
              (f"; {', '.join(unused)} set but unused" if unused else ""))
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


def _print_precision(config, joins: str | None) -> None:
    """Each agent's compute dtype and why, resolved as its trainer would on this machine. Trainers resolve on
    their own device when the run starts: the same unless they run on another node or a GPU this machine lacks."""
    import torch

    from agent_trainer.precision import capabilities, describe, native_bf16, resolve

    here = {kind: capabilities(kind) for kind in ("cpu", "cuda") if kind == "cpu" or torch.cuda.is_available()}
    cells = []
    for name, agent in config.agents.items():
        caps = here.get("cuda" if agent.resources.num_gpus > 0 else "cpu")
        if caps is None:
            cells.append(f"{name}: {agent.dtype} (decided on the trainer's GPU at start; this machine has none)")
            continue
        dtype, reason = resolve(agent.dtype, caps, model=agent.model)
        if dtype == "bfloat16" and native_bf16(caps) is None:
            reason += "; emulated here, often several times slower than float32: auto or float32 fits"
        cells.append(f"{name}: {dtype} ({reason})")
    elsewhere = "; trainers on other nodes decide on theirs at start" if joins else ""
    print(f"precision on this machine, {' and '.join(describe(c) for c in here.values())}{elsewhere}: "
          + "; ".join(cells))


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


def cmd_eval(args) -> int:
    """Evaluate checkpoints of a run (or a config's initial models); a run directory gets eval.jsonl rows."""
    from orchestrator.coordinator import Coordinator
    from orchestrator.evaluation import compare
    from orchestrator.runlog import RunLog
    from protocols.config import ConfigError

    target = Path(args.target)
    is_run = target.is_dir()
    config = load_config(target / "config.yaml" if is_run else target, args.overrides + ["train.progress=false"])
    if config.eval is None:
        raise ConfigError(f"{args.target}: the config has no eval: section; add one (or eval.data.path=... as an override)")
    log = RunLog(target) if is_run else None
    names = args.compare or _checkpoint_names(args.checkpoint or ("last" if is_run else "initial"), log)
    if not is_run and set(names) != {"initial"}:
        raise ConfigError(f"{args.target}: a config has only initial models to evaluate; give a run directory for checkpoints")
    results, labels = {}, {}
    with Coordinator(config) as coord:
        for name in sorted(names, key=lambda n: n != "initial"):  # initial first: the trainers start there
            step = 0
            if name != "initial":
                path = _checkpoint_path(name, log)  # `last` resolves now: a run may still be adding checkpoints
                coord.load_weights(path)
                step = int(path.name[5:])
            result = coord.evaluation.run(coord.generate, coord.assignment)
            results[name], labels[name] = result, name if name != "last" else f"last (step {step})"
            if log is not None:
                log.log_eval({"checkpoint": name, "step": step, "time": time.time(), **result.metrics,
                              "episodes": result.episodes})
    _print_eval_table({labels[name]: result for name, result in results.items()})
    if args.compare:
        first, second = results[args.compare[0]], results[args.compare[1]]
        a, b = labels[args.compare[0]], labels[args.compare[1]]
        if args.metric not in first.episodes[""]:
            raise ConfigError(f"--metric {args.metric}: not reported by every episode; have "
                              f"{', '.join(first.episodes[''])}")
        c = compare(first.episodes[""][args.metric], second.episodes[""][args.metric], first.samples)
        verdict = "distinguishable from noise" if c["distinguishable"] else "NOT distinguishable from noise"
        print(f"{args.metric} {b} - {a}: {c['difference']:+.4f} (95% CI {c['low']:+.4f} .. {c['high']:+.4f} over "
              f"{c['samples']} samples; {a} {c['before']:.4f}, {b} {c['after']:.4f}; {c['episodes']} paired episodes, "
              f"temperature {config.eval.temperature:g}): {verdict}")
    return 0


def _checkpoint_names(which: str, log) -> list[str]:
    if which == "all":
        return ["initial"] + ([p.name for p in log.checkpoints()] if log else [])
    return [which]


def _checkpoint_path(name: str, log) -> Path:
    from protocols.config import ConfigError

    found = {p.name: p for p in log.checkpoints()}
    if name == "last":
        if not found:
            raise ConfigError(f"{log.dir}: no complete checkpoint to evaluate")
        return max(found.values(), key=lambda p: int(p.name[5:]))
    if name not in found:
        raise ConfigError(f"{log.dir}: no checkpoint {name!r}; have initial, last, "
                          f"{', '.join(found) or '(none)'}")
    return found[name]


def _print_eval_table(results) -> None:
    """One row per checkpoint and setting (as trained, then each partner label), mean ± standard error."""
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
        cells = [f"{m[k]:.3f} ± {m.get(k + '/stderr', 0.0):.3f}" if k in m else "-" for k in keys]
        print(f"{title:28s} {int(m.get('episodes', 0)):8d}  " + "  ".join(f"{c:>20s}" for c in cells))


def _partner_key(key: str, result) -> bool:
    return any(label and key.startswith(f"eval/{label}/") for label in result.episodes)


def cmd_schema(args) -> int:
    print(json.dumps(RunConfig.model_json_schema(), indent=2))
    return 0


def cmd_plot(args) -> int:
    from orchestrator.plot import plot

    for path in plot(args.run_dir):
        print(path)
    return 0


def cmd_export(args) -> int:
    """Write an agent's weights at a checkpoint as a plain HF model: an adapter agent's adapter merged into its
    base (float32), a full-model agent's weights as saved, a frozen agent's source."""
    import tempfile

    from orchestrator.runlog import RunLog, checkpoint_problem, read_checkpoint_state
    from protocols.config import ConfigError

    run_dir, out = Path(args.run_dir), Path(args.out)
    config = load_config(run_dir / "config.yaml", check_imports=False)
    if args.agent not in config.agents:
        raise ConfigError(f"--agent {args.agent}: no such agent in {run_dir}; agents: {', '.join(config.agents)}")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty; give a new or empty directory")
    checkpoint = _checkpoint_path(args.checkpoint, RunLog(run_dir))
    problem = checkpoint_problem(checkpoint)
    if problem:
        raise FileNotFoundError(f"checkpoint {checkpoint} is damaged ({problem}); export another with --checkpoint step-N")
    with tempfile.TemporaryDirectory(prefix="marsi-export-") as tmp:
        source = checkpoint / "agents" / args.agent
        if not isinstance(source, Path):  # in train.storage: fetch this agent's files, checked against the manifest
            from agent_trainer import storage

            prefix = f"agents/{args.agent}/"
            files = {n[len(prefix):]: d for n, d in read_checkpoint_state(checkpoint)["manifest"].items()
                     if n.startswith(prefix)}
            problem = storage.download(source, files, Path(tmp))
            if problem:
                raise FileNotFoundError(f"checkpoint {checkpoint}: {prefix}{problem}")
            source = Path(tmp)
        model, tokenizer = _exported_model(config.agents[args.agent], source)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    print(f"marsi: wrote agent {args.agent!r} at {checkpoint.name} to {out} "
          f"({'adapter merged into ' + config.agents[args.agent].model if config.agents[args.agent].adapter else 'full model'})")
    return 0


def _exported_model(agent, source: Path):
    """(model, tokenizer) of a checkpoint's agent directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_trainer.adapters import ADAPTER_DIR, merged_model
    from agent_trainer.models import load_model

    if agent.adapter is not None:
        saved = source / ADAPTER_DIR if (source / ADAPTER_DIR).is_dir() else agent.adapter.path  # frozen: its source
        if saved is None:
            return load_model(agent.model, tokenizer=agent.tokenizer)  # a frozen, fresh adapter is the base
        return merged_model(agent, Path(saved))
    if (source / "model").is_dir():  # the trainer saved its tokenizer beside the weights
        return AutoModelForCausalLM.from_pretrained(source / "model"), AutoTokenizer.from_pretrained(source / "model")
    return load_model(agent.model, tokenizer=agent.tokenizer)  # no update yet (source.json): the model's own weights


COMMANDS = {"run": cmd_run, "resume": cmd_resume, "validate": cmd_validate, "eval": cmd_eval, "schema": cmd_schema,
            "plot": cmd_plot, "export": cmd_export}

if __name__ == "__main__":
    sys.exit(main())
