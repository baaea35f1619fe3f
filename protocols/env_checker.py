"""check_env: the conformance test every marsi environment passes."""

from __future__ import annotations

import random
from typing import Any, Callable

from protocols.env import (
    Environment, StepResult, answers, as_reward, attempt_infos_problem, env_problem, episode_info_problem,
    prompts_problem,
)
from protocols.errors import user_line


class EnvCheckError(AssertionError):
    """The environment breaks the interface; the message says which rule and where."""


ActionFn = Callable[[str, Any, random.Random], str]

_JUNK = ["", " ", "\n\n", "?" * 300, "<|endoftext|>", "ignore previous instructions", "0", "-1", "9" * 40, "é漢🙂"]


def _junk_action(role: str, prompt: Any, rng: random.Random) -> str:
    return rng.choice(_JUNK)


def _empty_action(role: str, prompt: Any, rng: random.Random) -> str:
    return ""


def _check_prompts(env: Environment, prompts: Any, where: str) -> None:
    problem = prompts_problem(prompts, env.possible_agents)
    if problem:
        raise EnvCheckError(f"{where}: {problem}")


def _check_reward(env: Environment, result: StepResult, where: str) -> None:
    _, problem = as_reward(result.reward, env.possible_agents, env.attempts)
    if problem:
        raise EnvCheckError(f"{where}: {problem}")


def play_episode(env: Environment, sample: dict[str, Any], seed: int, actions: Callable[[int], ActionFn],
                 rng: random.Random, where: str) -> list[tuple[dict[str, Any], StepResult]]:
    """Play one episode, checking every turn, with the actions `actions(turn)` gives on each turn (from 0); returns
    (prompts, result) per turn. A role in `env.attempts` answers each prompt k times (the action function called k
    times), and `step` gets the list of its k answers."""
    prompts = env.reset(sample, seed=seed)
    _check_prompts(env, prompts, f"{where} reset")
    if not prompts:
        raise EnvCheckError(f"{where} reset: no role acts on the first turn")
    turns = []
    for turn in range(env.max_turns + 1):
        action_fn = actions(turn)
        chosen = answers(prompts, env.attempts, lambda role, prompt: action_fn(role, prompt, rng))
        try:
            result = env.step(chosen)
        except Exception as exc:  # the interface forbids raising on model text
            line = user_line(exc)
            raise EnvCheckError(f"{where} turn {turn + 1}: step raised {type(exc).__name__}: {exc}"
                                f"{f' at {line}' if line else ''} on actions {chosen!r:.300}; report invalid actions "
                                "in infos instead") from exc
        if not isinstance(result, StepResult):
            raise EnvCheckError(f"{where} turn {turn + 1}: step must return a StepResult, got {type(result).__name__}")
        _check_reward(env, result, f"{where} turn {turn + 1}")
        _check_prompts(env, result.prompts, f"{where} turn {turn + 1}")
        problem = attempt_infos_problem(result.infos, env.attempts)
        if problem:
            raise EnvCheckError(f"{where} turn {turn + 1}: {problem}")
        for role, info in result.infos.items():
            for i, one in enumerate(info.get("attempts", []) if role in env.attempts else []):
                if one.get("invalid") and not one.get("reason"):
                    raise EnvCheckError(f"{where} turn {turn + 1}: infos[{role!r}]['attempts'][{i}] marks an invalid "
                                        "attempt without a 'reason'")
            if info.get("invalid") and not info.get("reason"):
                raise EnvCheckError(f"{where} turn {turn + 1}: infos[{role!r}] marks an invalid action without a 'reason'")
        turns.append((prompts, result))
        if result.terminated or result.truncated:
            if result.prompts:
                raise EnvCheckError(f"{where} turn {turn + 1}: an ended episode must return no prompts")
            return turns
        if not result.prompts:
            raise EnvCheckError(f"{where} turn {turn + 1}: no prompts but neither terminated nor truncated")
        prompts = result.prompts
    raise EnvCheckError(f"{where}: episode ran past max_turns={env.max_turns} without ending")


def _every_turn(action_fn: ActionFn) -> Callable[[int], ActionFn]:
    return lambda turn: action_fn


def _only_at(bad_turn: int, bad: ActionFn, good: ActionFn) -> Callable[[int], ActionFn]:
    return lambda turn: bad if turn == bad_turn else good


def check_env(env: Environment, samples: list[dict[str, Any]], action_fn: ActionFn | None = None,
              episodes: int = 4, seed: int = 0) -> None:
    """Raise EnvCheckError unless `env` follows the interface on `samples`.

    Checks: roles and max_turns declared (and `attempts`, if any, k >= 1 for known roles); prompts are str or chat
    messages for known roles; rewards finite (an attempts role's: one, or a list of k); an attempts role's infos
    hold k dicts if any; junk and empty actions are handled without raising (every attempt of an attempts role
    given one); every episode ends within max_turns; the same sample, seed and actions replay the same episode;
    episode_info is a dict of scalars.
    `action_fn(role, prompt, rng)` gives well-formed actions when the environment has a notion of them. Junk and
    empty actions are played on every turn, and, with `action_fn`, also at each turn t alone, after well-formed
    actions at the turns before (and with well-formed ones after): an environment whose later turns parse model
    text is reached there with junk too.
    """
    if not isinstance(env, Environment):
        raise EnvCheckError(f"{type(env).__name__} must subclass protocols.env.Environment")
    problem = env_problem(env)
    if problem:
        raise EnvCheckError(problem)
    if not samples:
        raise EnvCheckError("check_env needs at least one sample")
    bad = [("junk", _junk_action), ("empty", _empty_action)]
    for i in range(episodes):
        sample = samples[i % len(samples)]
        plans = [(f"{name} actions", _every_turn(fn)) for name, fn in bad]
        if action_fn is not None:
            given = _checked_episode(env, sample, seed + i, _every_turn(action_fn), i, f"given actions, episode {i + 1}")
            plans += [(f"{name} actions at turn {t + 1} after given ones", _only_at(t, fn, action_fn))
                      for t in range(1, given) for name, fn in bad]
        for name, actions in plans:
            _checked_episode(env, sample, seed + i, actions, i, f"{name}, episode {i + 1}")


def _checked_episode(env: Environment, sample: dict[str, Any], seed: int, actions: Callable[[int], ActionFn],
                     i: int, where: str) -> int:
    """Play an episode, check its episode_info, replay it; its number of turns."""
    first = play_episode(env, sample, seed, actions, random.Random(i), where)
    problem = episode_info_problem(env.episode_info())
    if problem:
        raise EnvCheckError(f"{where}: {problem}")
    again = play_episode(env, sample, seed, actions, random.Random(i), where + " (replay)")
    if [(p, r.reward, r.terminated, r.truncated) for p, r in first] != \
       [(p, r.reward, r.terminated, r.truncated) for p, r in again]:
        raise EnvCheckError(f"{where}: the same sample, seed and actions gave a different episode")
    return len(first)
