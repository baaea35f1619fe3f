"""check_env: the conformance test every marsi environment passes."""

from __future__ import annotations

import math
import random
from typing import Any, Callable

from protocols.env import Environment, StepResult


class EnvCheckError(AssertionError):
    """The environment breaks the interface; the message says which rule and where."""


ActionFn = Callable[[str, Any, random.Random], str]

_JUNK = ["", " ", "\n\n", "?" * 300, "<|endoftext|>", "ignore previous instructions", "0", "-1", "9" * 40, "é漢🙂"]


def _junk_action(role: str, prompt: Any, rng: random.Random) -> str:
    return rng.choice(_JUNK)


def _empty_action(role: str, prompt: Any, rng: random.Random) -> str:
    return ""


def _check_prompts(env: Environment, prompts: Any, where: str) -> None:
    if not isinstance(prompts, dict):
        raise EnvCheckError(f"{where}: prompts must be a dict role -> prompt, got {type(prompts).__name__}")
    for role, prompt in prompts.items():
        if role not in env.possible_agents:
            raise EnvCheckError(f"{where}: role {role!r} is not in possible_agents {env.possible_agents}")
        ok = isinstance(prompt, str) or (
            isinstance(prompt, list)
            and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt)
        )
        if not ok:
            raise EnvCheckError(f"{where}: prompt of {role!r} must be a str or a list of chat messages")


def _check_reward(env: Environment, result: StepResult, where: str) -> None:
    rewards = result.reward if isinstance(result.reward, dict) else {"shared": result.reward}
    for role, value in rewards.items():
        if role != "shared" and role not in env.possible_agents:
            raise EnvCheckError(f"{where}: reward for unknown role {role!r}")
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise EnvCheckError(f"{where}: reward {value!r} of {role!r} is not a finite number")


def play_episode(env: Environment, sample: dict[str, Any], seed: int, action_fn: ActionFn, rng: random.Random,
                 where: str) -> list[tuple[dict[str, Any], StepResult]]:
    """Play one episode, checking every turn; returns (prompts, result) per turn."""
    prompts = env.reset(sample, seed=seed)
    _check_prompts(env, prompts, f"{where} reset")
    if not prompts:
        raise EnvCheckError(f"{where} reset: no role acts on the first turn")
    turns = []
    for turn in range(env.max_turns + 1):
        actions = {role: action_fn(role, prompt, rng) for role, prompt in prompts.items()}
        try:
            result = env.step(actions)
        except Exception as exc:  # the interface forbids raising on model text
            raise EnvCheckError(f"{where} turn {turn}: step raised {type(exc).__name__}: {exc} on actions {actions!r}; "
                                "report invalid actions in infos instead") from exc
        if not isinstance(result, StepResult):
            raise EnvCheckError(f"{where} turn {turn}: step must return a StepResult, got {type(result).__name__}")
        _check_reward(env, result, f"{where} turn {turn}")
        _check_prompts(env, result.prompts, f"{where} turn {turn}")
        for role, info in result.infos.items():
            if info.get("invalid") and not info.get("reason"):
                raise EnvCheckError(f"{where} turn {turn}: infos[{role!r}] marks an invalid action without a 'reason'")
        turns.append((prompts, result))
        if result.terminated or result.truncated:
            if result.prompts:
                raise EnvCheckError(f"{where} turn {turn}: an ended episode must return no prompts")
            return turns
        if not result.prompts:
            raise EnvCheckError(f"{where} turn {turn}: no prompts but neither terminated nor truncated")
        prompts = result.prompts
    raise EnvCheckError(f"{where}: episode ran past max_turns={env.max_turns} without ending")


def check_env(env: Environment, samples: list[dict[str, Any]], action_fn: ActionFn | None = None,
              episodes: int = 4, seed: int = 0) -> None:
    """Raise EnvCheckError unless `env` follows the interface on `samples`.

    Checks: roles and max_turns declared; prompts are str or chat messages for known roles; rewards
    finite; junk and empty actions are handled without raising; every episode ends within max_turns;
    the same sample, seed and actions replay the same episode; episode_info is a dict of scalars.
    `action_fn(role, prompt, rng)` gives well-formed actions when the environment has a notion of them.
    """
    if not isinstance(env, Environment):
        raise EnvCheckError(f"{type(env).__name__} must subclass protocols.env.Environment")
    if not env.possible_agents or len(set(env.possible_agents)) != len(env.possible_agents):
        raise EnvCheckError("possible_agents must be a non-empty list of distinct role names")
    if not isinstance(env.max_turns, int) or env.max_turns < 1:
        raise EnvCheckError(f"max_turns must be a positive int, got {env.max_turns!r}")
    if not samples:
        raise EnvCheckError("check_env needs at least one sample")
    fns = [("junk", _junk_action), ("empty", _empty_action)] + ([("given", action_fn)] if action_fn else [])
    for name, fn in fns:
        for i in range(episodes):
            sample = samples[i % len(samples)]
            where = f"{name} actions, episode {i}"
            first = play_episode(env, sample, seed + i, fn, random.Random(i), where)
            info = env.episode_info()
            if not isinstance(info, dict) or not all(isinstance(v, (int, float, bool)) for v in info.values()):
                raise EnvCheckError(f"{where}: episode_info must be a dict of numbers, got {info!r}")
            again = play_episode(env, sample, seed + i, fn, random.Random(i), where + " (replay)")
            if [(p, r.reward, r.terminated, r.truncated) for p, r in first] != \
               [(p, r.reward, r.terminated, r.truncated) for p, r in again]:
                raise EnvCheckError(f"{where}: the same sample, seed and actions gave a different episode")
