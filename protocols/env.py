"""The turn-based environment interface.

Names follow PettingZoo: `possible_agents` are the environment's roles (marsi keeps "agent" for a
trainable policy), `reset` and `step` drive an episode, `terminated` / `truncated` end it, `infos`
carry per-role details. One turn: every acting role gets a prompt and answers with text; a role listed in
`attempts` answers its prompt k times in the turn (a solver trying one problem k times), and `step` gets the k
answers together.
"""

from __future__ import annotations

import abc
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from protocols.messages import Prompt

MAX_ABS_REWARD = 1e12
"""Rewards beyond this are refused as a bug (a sentinel value, an overflow): scale them down."""

Reward = float | dict[str, float | list[float]]
"""A shared team reward, or one reward per role (zero-sum games); a role listed in `attempts` may get a list of
k rewards, one per attempt (one float: the same for every attempt)."""


@dataclass
class StepResult:
    prompts: dict[str, Prompt]
    """Prompts of the roles that act next turn; empty when the episode ended."""
    reward: Reward
    """This turn's reward: one float shared by all roles (every attempt too), or one per role; an attempts role's
    may be a list of its k attempts' rewards."""
    terminated: bool = False
    """The episode reached a natural end."""
    truncated: bool = False
    """The episode was cut off (turn limit)."""
    infos: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per-role details; an invalid action is reported as infos[role] = {"invalid": True, "reason": ...}. An attempts
    role's may hold "attempts": [k dicts], one per attempt, each like a role's ({"invalid": True, "reason": ...},
    {"success": 1.0}: evaluation reports pass@k over a role's attempts from their `success`)."""


class Environment(abc.ABC):
    """A turn-based multi-role text environment. One instance plays one episode at a time."""

    possible_agents: list[str]
    """Every role that can act in this environment."""
    max_turns: int
    """Upper bound on turns per episode; the environment truncates at it."""
    attempts: dict[str, int] = {}
    """Roles that answer each of their prompts several times in one turn, each with its default k (`roles.attempts`
    in a run config overrides k). Such a role's entry in `step`'s actions is the list of its k answers (a list also
    when k is 1); a role not listed answers once."""
    batch: dict[str, Any] | None = None
    """What the episodes played together share: one dict that the rollout loop gives every environment of a batch
    (a training step's episodes, an evaluation's) before its `reset`, fresh for each batch; None outside a rollout.
    The loop steps turn t of every live episode before any episode's turn t + 1, so what turn t writes here is
    complete when turn t + 1 is stepped: a reward that depends on the other episodes of the batch (a penalty for a
    problem proposed twice, a rank among the proposals) reads it then."""

    @abc.abstractmethod
    def reset(self, sample: dict[str, Any], seed: int | None = None) -> dict[str, Prompt]:
        """Start an episode from a data sample; return the first turn's prompt per acting role."""

    @abc.abstractmethod
    def step(self, actions: dict[str, str | list[str]]) -> StepResult:
        """Apply one text action per acting role (an attempts role: the list of its k answers, in attempt order);
        never raise on bad model text (report it in infos)."""

    def episode_info(self) -> dict[str, Any]:
        """Scalar metrics of the finished episode (accuracy, win, legal-move rate); logged per episode.
        A `success` entry (1 or 0) marks a solved episode: evaluation reports its rate and pass@k."""
        return {}

    def scripted_action(self, role: str, prompt: Prompt) -> str:
        """An answer for `role` from a player the environment scripts (a random or rule-based opponent), for
        evaluations that seat it (`eval.partners: {label: {agent: scripted}}`). Optional."""
        raise NotImplementedError(f"{type(self).__name__} has no scripted player (define scripted_action)")


def answers(prompts: dict[str, Prompt], attempts: dict[str, int], act: Any) -> dict[str, str | list[str]]:
    """What `step` takes: `act(role, prompt)` for each acting role; a role in `attempts` (role -> k) a list of k."""
    return {role: [act(role, prompt) for _ in range(attempts[role])] if role in attempts else act(role, prompt)
            for role, prompt in prompts.items()}


# ------------------------------------------------------------------------------------- contract checks
# Each returns why a value breaks the interface (one phrase), or None; `check_env` and the rollout share them.
def env_problem(env: Any) -> str | None:
    roles = getattr(env, "possible_agents", None)
    if not isinstance(roles, (list, tuple)) or not roles or not all(isinstance(r, str) for r in roles) \
            or len(set(roles)) != len(roles):
        return f"possible_agents must be a non-empty list of distinct role names, got {roles!r}"
    turns = getattr(env, "max_turns", None)
    if not isinstance(turns, int) or isinstance(turns, bool) or turns < 1:
        return f"max_turns must be a positive int, got {turns!r}"
    attempts = getattr(env, "attempts", {})
    if not isinstance(attempts, dict) or not all(role in roles and isinstance(k, int) and not isinstance(k, bool)
                                                 and k >= 1 for role, k in attempts.items()):
        return f"attempts must be a dict role -> k (an int >= 1) over possible_agents {list(roles)}, got {attempts!r}"
    return None


def prompts_problem(prompts: Any, roles: list[str]) -> str | None:
    if not isinstance(prompts, dict):
        return f"prompts must be a dict role -> prompt, got {type(prompts).__name__}"
    for role, prompt in prompts.items():
        if role not in roles:
            return f"role {role!r} is not in possible_agents {list(roles)}"
        texts = [prompt] if isinstance(prompt, str) else (
            [m.get("content") for m in prompt] if isinstance(prompt, list) and all(
                isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt) else None)
        if texts is None or not all(isinstance(t, str) for t in texts):
            return f"prompt of {role!r} must be a str or a list of chat messages with str content, got {prompt!r:.80}"
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                return f"prompt of {role!r} is not valid text ({exc.reason} at position {exc.start})"
    return None


def as_reward(reward: Any, roles: list[str], attempts: dict[str, int] | None = None
              ) -> tuple[float | dict[str, float | list[float]] | None, str | None]:
    """(reward as plain floats, None), or (None, why it breaks the interface). Numpy numbers are accepted. A role in
    `attempts` (role -> k) may have a list of k rewards."""
    values = reward if isinstance(reward, dict) else {"": reward}
    out: dict[str, float | list[float]] = {}
    for role, value in values.items():
        if role != "" and role not in roles:
            return None, f"reward for unknown role {role!r}"
        if isinstance(value, (list, tuple)) and role in (attempts or {}):
            if len(value) != attempts[role]:
                return None, f"reward of {role!r} lists {len(value)} values for its {attempts[role]} attempts"
            parsed = [_number(v) for v in value]
            problem = next((p for _, p in parsed if p), None)
            if problem:
                return None, problem
            out[role] = [v for v, _ in parsed]
            continue
        if isinstance(value, (list, tuple)):
            return None, f"reward of {role!r} is a list, but {role!r} answers once (it is not in attempts)"
        out[role], problem = _number(value)
        if problem:
            return None, problem
    return (out[""] if "" in out else out), None


def _number(value: Any) -> tuple[float, str | None]:
    if not isinstance(value, numbers.Real):
        return 0.0, f"reward {value!r} is not a number"
    value = float(value)
    if not math.isfinite(value):
        return 0.0, f"reward {value!r} is not finite"
    if abs(value) > MAX_ABS_REWARD:
        return 0.0, f"reward {value!r} is beyond +-{MAX_ABS_REWARD:g}"
    return value, None


def attempt_infos_problem(infos: Any, attempts: dict[str, int]) -> str | None:
    """Why `infos` breaks the interface: not a dict role -> dict, or an attempts role's `"attempts"` entry not a
    list of k dicts."""
    if not isinstance(infos, dict):
        return "infos must be a dict role -> dict"
    for role, k in attempts.items():
        info = infos.get(role)
        if isinstance(info, dict) and "attempts" in info:
            tries = info["attempts"]
            if not isinstance(tries, list) or len(tries) != k or not all(isinstance(t, dict) for t in tries):
                return f"infos[{role!r}] 'attempts' must be a list of {k} dicts (one per attempt), got {tries!r:.80}"
    return None


def episode_info_problem(info: Any) -> str | None:
    if not isinstance(info, dict):
        return f"episode_info must return a dict of numbers, got {type(info).__name__}"
    for key, value in info.items():
        if not isinstance(key, str) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            return f"episode_info[{key!r}] must be a finite number, got {value!r:.80}"
    return None
