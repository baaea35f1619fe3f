"""Play groups of episodes turn by turn, batching each turn's prompts per agent across all live episodes. A role with
attempts (`Environment.attempts`, `roles.attempts`) has its prompt k times in its agent's batch: k actions, one per
attempt, whose answers its episode's `step` gets together as a list."""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from protocols.env import (
    Environment, StepResult, as_reward, attempt_infos_problem, env_problem, episode_info_problem, prompts_problem,
)
from protocols.errors import UserError, user_line
from protocols.messages import Completion, Prompt


class EnvironmentFault(UserError, RuntimeError):
    """An environment raised or broke its contract; the message names the episode and turn."""


@dataclass
class Action:
    role: str
    agent: str
    prompt: Prompt
    completion: Completion
    advantage: float | None = None
    """Set when the action is scored for an update (orchestrator/advantages.py); None for evaluation episodes."""
    attempt: int | None = None
    """Which of its role's k attempts at this prompt (0 .. k-1); None for a role that answers once."""


@dataclass
class Turn:
    actions: list[Action]
    reward: float | dict[str, float | list[float]]
    """As the environment returned it: shared, per role, and per attempt for an attempts role (a list of k)."""
    infos: dict[str, dict[str, Any]]

    def reward_of(self, role: str, attempt: int | None = None) -> float:
        """`role`'s reward at this turn: the shared one or its own; an attempts role's is that attempt's, or, without
        an attempt, the mean over its attempts."""
        value = self.reward.get(role, 0.0) if isinstance(self.reward, dict) else self.reward
        if isinstance(value, list):
            return value[attempt] if attempt is not None else statistics.fmean(value)
        return value

    def info_of(self, action: Action) -> dict[str, Any]:
        """What the environment said of `action`: its role's infos, or its attempt's entry in them."""
        info = self.infos.get(action.role, {})
        if action.attempt is not None and "attempts" in info:
            return info["attempts"][action.attempt]
        return info


@dataclass
class Episode:
    index: int
    """Episode number within the run (rotation per episode counts these)."""
    sample_index: int
    """Position of its sample in this step's batch: the group id."""
    env: Environment
    turns: list[Turn] = field(default_factory=list)
    prompts: dict[str, Prompt] = field(default_factory=dict)
    """Prompts of the roles acting next; empty once the episode ended."""
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    next_prompts: dict[str, Prompt] = field(default_factory=dict)
    """Once ended: the prompts the last step returned (a truncated episode's next observations, which a critic
    values to bootstrap; usually none after a termination)."""

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    def role_rewards(self, role: str) -> list[float]:
        """Per-turn reward seen by `role`: the shared reward, or its own in per-role games (an attempts role's: the
        mean over its attempts)."""
        return [t.reward_of(role) for t in self.turns]

    def total_reward(self) -> float | dict[str, float]:
        if any(isinstance(t.reward, dict) for t in self.turns):
            return {r: sum(self.role_rewards(r)) for r in self.env.possible_agents}
        return sum(t.reward for t in self.turns)

    def policy_versions(self) -> dict[str, int]:
        """The policy version of every agent that acted in this episode (its oldest, should it have acted at
        several); the environment's scripted player has none."""
        versions: dict[str, int] = {}
        for turn in self.turns:
            for a in turn.actions:
                if a.completion.policy_version is not None:
                    versions[a.agent] = min(versions.get(a.agent, a.completion.policy_version), a.completion.policy_version)
        return versions

    def record(self) -> dict[str, Any]:
        """The episode as JSON values, whole enough to score and train on (`from_record`): what a checkpoint keeps
        of a rollout played ahead of its step."""
        return {"index": self.index, "sample_index": self.sample_index, "roles": list(self.env.possible_agents),
                "terminated": self.terminated, "truncated": self.truncated, "info": self.info,
                "turns": [{"reward": t.reward, "infos": t.infos,
                           "actions": [{"role": a.role, "agent": a.agent, "prompt": a.prompt,
                                        "completion": a.completion.model_dump(), **_attempt(a)} for a in t.actions]}
                          for t in self.turns]}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Episode:
        """An ended episode from `record()`; its `env` only names the roles (it cannot be stepped)."""
        turns = [Turn([Action(a["role"], a["agent"], a["prompt"], Completion(**a["completion"]),
                              attempt=a.get("attempt")) for a in t["actions"]], t["reward"], t["infos"])
                 for t in record["turns"]]
        return cls(index=record["index"], sample_index=record["sample_index"], env=RecordedRoles(record["roles"]),
                   turns=turns, terminated=record["terminated"], truncated=record["truncated"], info=record["info"])

    def transcript(self) -> dict[str, Any]:
        return {
            "episode": self.index, "sample": self.sample_index, "terminated": self.terminated,
            "truncated": self.truncated, "reward": self.total_reward(), "info": self.info,
            "policy_versions": self.policy_versions(),
            "turns": [{"reward": t.reward, "infos": t.infos,
                       "actions": [{"role": a.role, "agent": a.agent, "prompt": a.prompt, "completion": a.completion.text,
                                    "finish_reason": a.completion.finish_reason, "advantage": a.advantage,
                                    "policy_version": a.completion.policy_version, **_attempt(a)} for a in t.actions]}
                      for t in self.turns],
        }


def _attempt(action: Action) -> dict[str, int]:
    """The attempt index as records and transcripts carry it: only for an attempts role's actions."""
    return {} if action.attempt is None else {"attempt": action.attempt}


class RecordedRoles:
    """The environment of an episode read back from a record: its roles, nothing to step."""

    def __init__(self, possible_agents: list[str]):
        self.possible_agents = list(possible_agents)


def derive_seed(*parts: Any) -> int:
    """A stable 63-bit seed from any parts (the same on every process and run)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


GenerateFn = Callable[[dict[str, list[Prompt]], int], dict[str, list[Completion]]]


SCRIPTED = "<scripted>"
"""The seat of a role the environment answers itself (`Environment.scripted_action`), in evaluations."""


def play(make_env: Callable[[], Environment], samples: list[dict[str, Any]], num_generations: int,
         assignment: Callable[[int, int], dict[str, str]], generate: GenerateFn, *, seed: int,
         first_episode: int, attempts: dict[str, int] | None = None) -> list[Episode]:
    """Play `num_generations` episodes per sample until all end; one batched generate per turn for all agents.
    A role seated to `SCRIPTED` is answered by its episode's `env.scripted_action`. A role in the environment's
    `attempts`, or in `attempts` (role -> k, over the environment's), has its prompt k times in its agent's batch,
    and its step entry is the list of the k answers. The call's environments share one dict (`Environment.batch`)."""
    episodes, batch = [], {}  # what this call's environments share (`Environment.batch`)
    for s, sample in enumerate(samples):
        for g in range(num_generations):
            index = first_episode + s * num_generations + g
            episode = Episode(index=index, sample_index=s, env=make_environment(make_env))
            episode.env.batch = batch
            prompts = _guard(episode, 0, "reset", lambda: episode.env.reset(dict(sample), seed=derive_seed(seed, index)))
            _check(episode, 0, "reset", prompts_problem(prompts, episode.env.possible_agents)
                   or (None if prompts else "no role acts on the first turn (empty prompts)"))
            episode.prompts = prompts
            episodes.append(episode)
    turn = 0
    while live := [e for e in episodes if not e.done]:
        # every live episode's prompts, gathered per agent (an attempts role's k times)
        wanted: dict[str, list[tuple[Episode, str, Prompt, int | None]]] = {}
        for episode in live:
            seats = assignment(episode.index, turn)
            tries = attempts_of(episode.env, attempts)
            for role, prompt in episode.prompts.items():
                if role not in seats:
                    raise EnvironmentFault(f"{_where(episode, turn)}: role {role!r} has no agent in "
                                           f"roles.assignment ({', '.join(seats)}); seat every role the environment uses")
                rows = range(tries[role]) if role in tries else [None]
                wanted.setdefault(seats[role], []).extend((episode, role, prompt, attempt) for attempt in rows)
        scripted = wanted.pop(SCRIPTED, [])
        completions = generate({agent: [p for _, _, p, _ in items] for agent, items in wanted.items()},
                               derive_seed(seed, first_episode, turn))
        if scripted:
            wanted[SCRIPTED] = scripted
            completions[SCRIPTED] = [_scripted(episode, turn, role, prompt) for episode, role, prompt, _ in scripted]
        # answers go back to their episodes
        actions: dict[tuple[int, str], list[Action]] = {}
        for agent, items in wanted.items():
            for (episode, role, prompt, attempt), completion in zip(items, completions[agent]):
                actions.setdefault((episode.index, role), []).append(Action(role, agent, prompt, completion,
                                                                            attempt=attempt))
        for episode in live:
            mine = [a for role in episode.prompts for a in actions[episode.index, role]]
            answers = {role: _answers(actions[episode.index, role]) for role in episode.prompts}
            tries = attempts_of(episode.env, attempts)
            result = _guard(episode, turn, "step", lambda: episode.env.step(answers))
            if not isinstance(result, StepResult):
                _check(episode, turn, "step", f"must return a StepResult, got {type(result).__name__}")
            reward, problem = as_reward(result.reward, episode.env.possible_agents, tries)
            _check(episode, turn, "step", problem or prompts_problem(result.prompts, episode.env.possible_agents)
                   or attempt_infos_problem(result.infos, tries))
            episode.turns.append(Turn(mine, reward, result.infos))
            episode.prompts = episode.next_prompts = result.prompts
            episode.terminated, episode.truncated = result.terminated, result.truncated
            if not episode.done and not result.prompts:
                raise EnvironmentFault(f"{_where(episode, turn)}: step returned no prompts but did not "
                                        "end the episode; set terminated or truncated")
            if not episode.done and turn + 1 >= episode.env.max_turns:
                episode.truncated, episode.prompts = True, {}
            if episode.done:
                info = _guard(episode, turn, "episode_info", episode.env.episode_info)
                _check(episode, turn, "episode_info", episode_info_problem(info))
                episode.info = {k: float(v) for k, v in info.items()}
        turn += 1
    return episodes


def attempts_of(env: Environment, attempts: dict[str, int] | None = None) -> dict[str, int]:
    """Role -> k of the roles that answer each prompt k times: the environment's `attempts`, `attempts` over them."""
    return {**getattr(env, "attempts", {}), **(attempts or {})}


def _answers(actions: list[Action]) -> str | list[str]:
    """What `step` gets from one role: its answer, or an attempts role's list of answers in attempt order."""
    return actions[0].completion.text if actions[0].attempt is None else [a.completion.text for a in actions]


def _scripted(episode: Episode, turn: int, role: str, prompt: Prompt) -> Completion:
    text = _guard(episode, turn, "scripted_action", lambda: episode.env.scripted_action(role, prompt))
    _check(episode, turn, "scripted_action", None if isinstance(text, str) else f"must return text, got {text!r:.60}")
    return Completion(text=text, prompt_ids=[], completion_ids=[], per_token_logps=[], finish_reason="stop")


def env_factory(spec: str, kwargs: dict[str, Any]) -> Callable[[], Environment]:
    """A no-argument constructor of the environment `spec` names, named for error messages by its spec."""
    from protocols.imports import import_object

    env_cls = import_object(spec)

    def make_env():
        return env_cls(**kwargs)

    make_env.__name__ = f"environment.name {spec}"
    return make_env


def make_environment(make_env: Callable[[], Environment]) -> Environment:
    """A new environment, checked against the interface (roles, max_turns)."""
    name = getattr(make_env, "__name__", "the environment")
    try:
        env = make_env()
    except UserError:
        raise
    except Exception as exc:
        line = user_line(exc)
        raise EnvironmentFault(f"{name}: constructing it with environment.kwargs raised {type(exc).__name__}: "
                               f"{' '.join(str(exc).split())}{f' at {line}' if line else ''}; fix environment.kwargs "
                               "or the constructor (--debug shows the traceback)") from exc
    problem = env_problem(env)
    if problem:
        raise EnvironmentFault(f"{type(env).__name__}: {problem}; fix the environment (check it with check_env)")
    return env


def _where(episode: Episode, turn: int) -> str:
    """How messages name a turn of an episode: both counted from 1, as `marsi validate` prints them."""
    return f"episode {episode.index + 1} turn {turn + 1}"


def _guard(episode: Episode, turn: int, what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except UserError:  # already one line naming its cause (e.g. a sandbox that cannot contain model code)
        raise
    except Exception as exc:
        line = user_line(exc)
        raise EnvironmentFault(f"{_where(episode, turn)}: {type(episode.env).__name__}.{what} raised "
                                f"{type(exc).__name__}: {' '.join(str(exc).split())}{f' at {line}' if line else ''}; "
                                "fix the environment (check it with check_env; --debug shows the traceback)") from exc


def _check(episode: Episode, turn: int, what: str, problem: str | None) -> None:
    if problem:
        raise EnvironmentFault(f"{_where(episode, turn)}: {type(episode.env).__name__}.{what}: {problem}; "
                                "fix the environment (check it with check_env)")
