"""Small environments and data for coordinator tests."""

from __future__ import annotations

import time
from pathlib import Path

import datasets

from protocols.env import Environment, StepResult


HERE = Path(__file__).resolve().parent


class LetterEnv(Environment):
    """Every role is asked for the sample's letter on each of `turns` turns; shared reward: fraction right.
    With `zero_sum`, the first role gets +1 / -1 when it alone is right / wrong, the others the opposite.
    Roles in `silent` are seated but never prompted; `delay` seconds pass in every reset."""

    def __init__(self, roles=("x",), turns=1, zero_sum=False, silent=(), delay=0.0):
        self.possible_agents, self.max_turns, self.zero_sum = list(roles), turns, zero_sum
        self.acting = [r for r in self.possible_agents if r not in silent]
        self.delay = delay

    def reset(self, sample, seed=None):
        time.sleep(self.delay)
        self.target, self.turn, self.hits = sample["target"], 0, 0
        return {r: f"Say {self.target}" for r in self.acting}

    def step(self, actions):
        right = {r: text[:1] == self.target for r, text in actions.items()}
        self.turn += 1
        self.hits += sum(right.values())
        infos = {r: {"invalid": True, "reason": "empty answer"} for r, text in actions.items() if not text}
        if self.zero_sum:
            first, *others = self.possible_agents
            score = float(right[first]) - sum(right[o] for o in others) / len(others)
            reward = {first: score, **{o: -score for o in others}}
        else:
            reward = sum(right.values()) / len(right)
        done = self.turn >= self.max_turns
        prompts = {} if done else {r: f"Say {self.target}" for r in self.acting}
        return StepResult(prompts=prompts, reward=reward, terminated=done, infos=infos)

    def episode_info(self):
        return {"hits": float(self.hits), "success": float(self.hits == self.turn * len(self.acting))}

    def scripted_action(self, role, prompt):
        """A scripted player that always knows the letter."""
        return self.target


def letters(n: int = 8) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"target": "abcd"[i % 4]} for i in range(n)])


def held_out(n: int = 4) -> datasets.Dataset:
    """Evaluation samples, none of them a training sample (`letters`)."""
    return datasets.Dataset.from_list([{"target": "abcd"[i % 4], "held_out": i} for i in range(n)])


def config(agents=("a", "b"), roles=None, *, turns=1, ray=False, **sections) -> dict:
    """A run-config mapping on the tiny model; `sections` replace or extend whole sections."""
    roles = roles or {f"r{i}": a for i, a in enumerate(agents)}
    raw = {
        "agents": {a: {"model": "builtin:tiny", "generation": {"max_completion_length": 2},
                       "optimizer": {"lr": 1e-3}, "resources": {"num_cpus": 0.5}} for a in agents},
        "environment": {"name": f"{HERE / 'envs.py'}:LetterEnv", "kwargs": {"roles": list(roles), "turns": turns}},
        "roles": {"assignment": roles},
        "data": {"factory": f"{HERE / 'envs.py'}:letters"},
        "train": {"steps": 2, "batch_size": 2, "num_generations": 2, "progress": False},
        "ray": {"enabled": ray},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


_played: dict[str, int] = {}


class BrokenEnv(LetterEnv):
    """LetterEnv that misbehaves once `after` episodes (counted per `token`) have started: `fail` is
    "reset" or "step" (raise there), "nan" or "inf" (return that reward)."""

    def __init__(self, fail="step", after=0, token="", **kwargs):
        super().__init__(**kwargs)
        self.fail, self.after, self.token = fail, after, token

    def reset(self, sample, seed=None):
        _played[self.token] = _played.get(self.token, 0) + 1
        self.broken = _played[self.token] > self.after
        if self.broken and self.fail == "reset":
            raise KeyError("target")
        return super().reset(sample, seed)

    def step(self, actions):
        result = super().step(actions)
        if self.broken and self.fail == "step":
            raise ZeroDivisionError("division by zero")
        if self.broken and self.fail in ("nan", "inf"):
            result.reward = float(self.fail)
        return result


def empty() -> datasets.Dataset:
    return datasets.Dataset.from_list([])


def raising_factory() -> datasets.Dataset:
    raise FileNotFoundError("tasks.jsonl")


class FaultyEnv(LetterEnv):
    """LetterEnv that breaks the interface in one way, named by `fault`."""

    def __init__(self, fault="", **kwargs):
        if fault == "constructor":
            raise TypeError("FaultyEnv() got an unexpected keyword argument 'levels'")
        super().__init__(**kwargs)
        self.fault = fault
        if fault == "max_turns_none":
            self.max_turns = None

    def reset(self, sample, seed=None):
        prompts = super().reset(sample, seed)
        if self.fault == "reset_none":
            return None
        if self.fault == "bytes_prompt":
            return {r: p.encode() for r, p in prompts.items()}
        if self.fault == "surrogate_prompt":
            return {r: p + "\ud800" for r, p in prompts.items()}
        return prompts

    def step(self, actions):
        result = super().step(actions)
        if self.fault == "step_none":
            return None
        if self.fault == "step_dict":
            return {"prompts": result.prompts, "reward": result.reward}
        if self.fault == "huge_reward":
            result.reward = 1e308
        if self.fault == "numpy_reward":
            import numpy as np

            result.reward = np.float32(result.reward)
        return result

    def episode_info(self):
        return {"hits": "many"} if self.fault == "info_text" else super().episode_info()


class ByteScoreEnv(LetterEnv):
    """LetterEnv whose shared reward is the first answer byte's value / 255: it varies from the first step on,
    so even an untrained model's updates move its weights."""

    def step(self, actions):
        result = super().step(actions)
        result.reward = sum(text.encode()[0] / 255 if text else 0.0 for text in actions.values()) / len(actions)
        return result


class AttemptsEnv(Environment):
    """A proposer names a letter (the first character of its answer; the sample's if it says nothing), then a solver
    tries to say it, `attempts["solver"]` times at one prompt. Each attempt's reward: 1 if right, else 0 (an empty one
    is invalid); the proposer's: learnability, 1 - p when 0 < p < 1, else 0, p the share of attempts right."""

    possible_agents = ["proposer", "solver"]
    max_turns = 2
    attempts = {"solver": 3}

    def reset(self, sample, seed=None):
        self.target, self.letter, self.p = sample["target"], None, 0.0
        return {"proposer": f"Say {self.target}"}

    def step(self, actions):
        if "proposer" in actions:
            self.letter = actions["proposer"][:1] or self.target
            return StepResult(prompts={"solver": f"Say {self.letter}"}, reward=0.0)
        tries = actions["solver"]
        right = [float(text[:1] == self.letter) for text in tries]
        self.p = sum(right) / len(right)
        infos = {"solver": {"attempts": [{"success": r} if text else {"invalid": True, "reason": "empty answer"}
                                         for text, r in zip(tries, right)]}}
        learnability = 1.0 - self.p if 0 < self.p < 1 else 0.0
        return StepResult(prompts={}, reward={"proposer": learnability, "solver": right}, terminated=True, infos=infos)

    def episode_info(self):
        return {"solved": self.p}


def attempts_config(**sections) -> dict:
    """Agents p (proposer) and s (solver, 3 attempts per prompt by default) on AttemptsEnv."""
    return config(("p", "s"), roles={"proposer": "p", "solver": "s"},
                  environment={"name": f"{HERE / 'envs.py'}:AttemptsEnv", "kwargs": {}}, **sections)


class FaultyAttemptsEnv(AttemptsEnv):
    """AttemptsEnv that breaks the attempts interface in one way, named by `fault`."""

    def __init__(self, fault=""):
        self.fault = fault
        if fault == "attempts_zero":
            self.attempts = {"solver": 0}

    def step(self, actions):
        result = super().step(actions)
        if "solver" in actions and self.fault == "rewards_short":
            result.reward["solver"] = result.reward["solver"][:2]
        if "solver" in actions and self.fault == "infos_short":
            result.infos["solver"]["attempts"].pop()
        return result
