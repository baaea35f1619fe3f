"""Bad input that marsi finds before it starts anything (Ray, trainers, a run directory): the environment's
constructor against `environment.kwargs`, seats the environment cannot fill, a trial episode played by a run's
own loop and `check_env`, a run directory for `marsi eval`, `train.storage` against the run directory, and
whether the Ray cluster can place the trainers (the local one against this machine's node, before it starts).

Each check raises (or returns) one line naming the key, file or episode and the fix, as every user error does."""

from __future__ import annotations

import inspect
import os
import random
import sys
from pathlib import Path
from typing import Any, Callable

from orchestrator import rollout
from orchestrator.runlog import STORE_RECORD
from protocols.config import ConfigError, RunConfig, joins_cluster
from protocols.env import Environment
from protocols.env_checker import EnvCheckError, check_env
from protocols.imports import import_object
from protocols.messages import Completion
from protocols.plan import RunPlan

ActionFn = Callable[[str, Any, random.Random], str]


# ------------------------------------------------------------------------------------- the environment
def check_environment(config: RunConfig) -> None:
    """The environment's constructor takes every key of `environment.kwargs` (and of `eval.environment_kwargs`),
    and every `eval.partners` setting that seats `scripted` has an environment that scripts a player."""
    env_cls = import_object(config.environment.name)
    kwargs = [("environment.kwargs", config.environment.kwargs)]
    if config.eval is not None:
        kwargs.append(("eval.environment_kwargs", config.eval.environment_kwargs))
    for key, given in kwargs:
        problem = kwargs_problem(env_cls, given)
        if problem:
            raise ConfigError(f"{key}: {problem}")
    scripts = not isinstance(env_cls, type) or getattr(env_cls, "scripted_action", None) not in (
        None, Environment.scripted_action)  # a factory function's class is known only once it is called
    if scripts:
        return
    for label, held in (config.eval.partners if config.eval else {}).items():
        for agent, weights in held.items():
            if weights == "scripted":
                raise ConfigError(f"eval.partners.{label}.{agent}: scripted seats the environment's own player, but "
                                  f"{env_cls.__name__} defines no scripted_action(role, prompt); define it, or seat "
                                  "initial or a checkpoint's agent directory there")


def kwargs_problem(env_cls: type, kwargs: dict[str, Any]) -> str | None:
    """Why `env_cls(**kwargs)` cannot take these keyword arguments, by its signature (the class and the parameters
    it takes), or None; a constructor with **kwargs takes any, and one whose signature cannot be read is let be."""
    try:
        parameters = inspect.signature(env_cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    takes = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in takes]
    if not unknown:
        return None
    return (f"{env_cls.__name__}'s constructor has no parameter {', '.join(map(repr, unknown))} (it takes "
            f"{', '.join(takes) or 'none'}); fix the name or remove it")


# ------------------------------------------------------------------------------------- the trial episode
def well_formed_actions(env_cls: type) -> ActionFn | None:
    """The environment module's `sample_action(role, prompt, rng)`, the well-formed answers check_env plays, or None."""
    return getattr(sys.modules.get(env_cls.__module__), "sample_action", None)


def trial_episode(make_env: Callable[[], Environment], sample: dict[str, Any], seed: int,
                  attempts: dict[str, int] | None = None) -> rollout.Episode:
    """One episode on `sample`, played by a run's own loop (`rollout.play`, so with a run's checks and its messages
    naming the class, file:line, episode and turn), each role seated by itself and answered by the environment
    module's `sample_action`, when it has one, else with empty text (k answers for a role of `attempts`, over
    the environment's own)."""
    env = rollout.make_environment(make_env)
    act = well_formed_actions(type(env)) or (lambda role, prompt, rng: "")
    rng, seats = random.Random(0), {role: role for role in env.possible_agents}

    def answer(prompts: dict[str, list], seed: int) -> dict[str, list[Completion]]:
        return {role: [Completion(text=act(role, prompt, rng), prompt_ids=[], completion_ids=[], per_token_logps=[],
                                  finish_reason="stop") for prompt in items] for role, items in prompts.items()}

    make_env_once = lambda: env  # noqa: E731  (constructed and checked above)
    make_env_once.__name__ = getattr(make_env, "__name__", "the environment")
    [episode] = rollout.play(make_env_once, [dict(sample)], 1, lambda index, turn: seats, answer, seed=seed,
                             first_episode=0, attempts=attempts)
    return episode


def checked_trial(make_env: Callable[[], Environment], sample: dict[str, Any], seed: int,
                  attempts: dict[str, int] | None = None) -> rollout.Episode:
    """`trial_episode`, then `check_env` on the same sample with the module's `sample_action` (junk and empty
    answers at each turn, replays, the reasons of invalid answers): the checks of a run and of check_env."""
    episode = trial_episode(make_env, sample, seed, attempts)
    env = rollout.make_environment(make_env)
    try:
        check_env(env, [dict(sample)], action_fn=well_formed_actions(type(env)), episodes=1, seed=seed)
    except EnvCheckError as exc:
        raise rollout.EnvironmentFault(f"{type(env).__name__}: check_env on the first sample: {' '.join(str(exc).split())}; "
                                       "fix the environment (--debug shows the traceback)") from exc
    return episode


# ------------------------------------------------------------------------------------- run directories
def is_run_directory(path: Path) -> bool:
    """A directory a run wrote: its config.yaml beside a record of the run (an example's directory has the former only)."""
    return (path / "config.yaml").is_file() and any((path / name).exists()
                                                    for name in ("metrics.jsonl", "checkpoints", ".lock", STORE_RECORD))


def evaluated_run_problem(target: Path) -> str | None:
    """Why the directory `target` is not a run directory `marsi eval` can read (no config.yaml; a config.yaml
    beside no record of a run: an example's directory), or None."""
    if not (target / "config.yaml").is_file():
        return (f"{target}: not a run directory (no config.yaml in it); give a run directory as marsi run printed "
                "it, a run's place in train.storage (STORAGE/RUN_NAME), or a config file")
    if not is_run_directory(target):
        return (f"{target}: not a run directory (a config.yaml, but no metrics.jsonl or checkpoints of a run); "
                f"for that config's initial models give the file itself: marsi eval {target / 'config.yaml'}")
    return None


def storage_place_problem(storage: str | None, run_dir: Path) -> str | None:
    """Why `train.storage` (a path or file:// URI) cannot hold the checkpoints of the run in `run_dir`: the run's
    place in it (STORAGE/RUN_NAME) would lie in the run directory, or in another run's directory; None for
    object stores and other places."""
    if storage is None or ("://" in storage and not storage.startswith("file://")):
        return None
    root, run_dir = Path(storage.removeprefix("file://")).resolve(), run_dir.resolve()
    place = root / run_dir.name
    if place.is_relative_to(run_dir):
        return (f"train.storage {storage}: the run's place in it, {place}, would lie in the run directory {run_dir}; "
                "leave train.storage out (checkpoints stay in the run directory) or give a place outside it")
    for parent in (place, *place.parents):
        if is_run_directory(parent):
            return (f"train.storage {storage}: the run's place in it, {place}, would lie in {parent}, the directory "
                    "of another run, and write into it; give a place outside every run directory")
    return None


# ------------------------------------------------------------------------------------- the Ray cluster
def check_cluster(config: RunConfig, plan: RunPlan, source: str | Path) -> None:
    """Check that the Ray cluster can place the trainers (CPUs and GPUs in all, custom resources, GPU types, node
    labels): the local cluster a run would start, against this machine's node before it starts (ConfigError
    naming `source`); a cluster marsi joins (ray.address, RAY_ADDRESS), joined for the check and left again, or
    the one this process is connected to (PlacementError naming the agent). `plan`: the config's
    (`protocols.plan`)."""
    from agent_trainer.group import local_cluster_problem
    from agent_trainer.handle import PlacementError

    if not config.ray.enabled:
        return
    if not joins_cluster(config.ray) and not ray_is_up():
        problem = local_cluster_problem(config, plan)
        if problem:
            raise ConfigError(f"{source}: {problem}")
        return
    import ray

    from agent_trainer.actor import cluster_problem, quiet_ray_startup

    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    joined = not ray.is_initialized()
    if joined:
        quiet_ray_startup()
        ray.init(address=address, logging_level="WARNING")
    try:
        problem = cluster_problem(config, plan)
    finally:
        if joined:
            ray.shutdown()
    if problem:
        raise PlacementError(problem)


def ray_is_up() -> bool:
    """Whether this process is connected to Ray (a test's, a notebook's), without importing Ray when it is not."""
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()
