"""Held-out evaluation: who plays at which weights, metrics with standard errors, pass@k, and paired
comparisons of two evaluations.

An evaluation plays `eval.episodes_per_sample` episodes from each held-out sample with the evaluation
environment kwargs and temperature (0: greedy), under the run's role rotation, once as trained and once
per partner setting: `eval.partners: {label: {agent: initial | scripted | DIR}}` seats that agent at its
initial weights, as the environment's scripted player, or with the weights in DIR (extra frozen
trainers named `agent@label`). Its seeds are the same at every evaluation and in every setting (a partner
trainer samples with the seeds of the agent it sits in for), so two evaluations of one run, or two
settings of one evaluation, differ only by the weights (common random numbers); at the initial weights a
setting that holds agents at `initial` is the trained setting and is not played twice. It touches no
training state: no data position, episode count, baseline or trainer RNG.

Metrics, under `eval/` (`eval/LABEL/` for a partner setting): `reward/mean` (the shared reward; in
per-role games the mean over roles) and `reward/ROLE`, `episode/KEY` for every `episode_info` entry,
each with a `.../stderr`, `episodes`, and where episodes report `success`, `pass@k` for the k asked
(the unbiased estimator 1 - C(n-c, k) / C(n, k) per sample, averaged); where a role's attempts report
`success` (`infos[role]["attempts"]`), `pass@k/ROLE`: the same estimator per prompt over its n attempts,
averaged over prompts. Evaluation plays the training run's attempts unless `eval.attempts` says otherwise.

Episodes of one sample are not independent (at temperature 0 with a deterministic environment they are
copies), so the samples are the units: every mean is the mean of the per-sample means (each held-out sample
weighs the same, however many of its episodes report the metric), its standard error and confidence interval
are over those per-sample means (n = samples, not episodes), and `compare`'s difference is after - before of
those means, so it equals the two figures it is printed beside.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator import rollout
from orchestrator.data import load_samples
from protocols.config import AgentConfig, ConfigError, RunConfig

PARTNER = "@"  # a partner trainer is named AGENT@LABEL


def partner_agents(config: RunConfig) -> dict[str, AgentConfig]:
    """The extra frozen trainers `eval.partners` needs: `agent@label` -> its AgentConfig."""
    out = {}
    for label, held in (config.eval.partners if config.eval else {}).items():
        for agent, weights in held.items():
            if weights != "scripted":
                own = config.agents[agent]
                # a host of its own, which samples in its own process: a frozen partner needs no engine apart
                rollout = own.rollout.model_copy(update={"placement": "colocated", "resources": None})
                update = {"resources": config.eval.partner_resources, "host": None, "rollout": rollout}
                if own.adapter is None:
                    update["model"] = own.model if weights == "initial" else _model_dir(weights)
                elif weights != "initial":  # the base, with the adapter a checkpoint or adapter directory holds
                    update["adapter"] = own.adapter.model_copy(update={"path": _adapter_dir(weights)})
                # initial: the agent's own adapter settings, as it started (a fresh adapter, or adapter.path)
                out[f"{agent}{PARTNER}{label}"] = own.model_copy(update=update)
    return out


def partner_seats(config: RunConfig) -> dict[str, str]:
    """Each partner trainer -> the agent it sits in for: it samples with that agent's seeds (common random numbers)."""
    return {f"{agent}{PARTNER}{label}": agent for label, held in (config.eval.partners if config.eval else {}).items()
            for agent, weights in held.items() if weights != "scripted"}


def _model_dir(path: str) -> str:
    """A checkpoint's agent directory holds its weights under `model/`; a model directory is itself."""
    return _inside(path, "model", "config.json")


def _adapter_dir(path: str) -> str:
    """A checkpoint's agent directory holds an adapter agent's adapter under `adapter/`; an adapter directory is itself."""
    return _inside(path, "adapter", "adapter_config.json")


def _inside(path: str, part: str, marker: str) -> str:
    """`path/part` if it holds `marker`, else `path`."""
    return str(Path(path) / part) if (Path(path) / part / marker).exists() else path


@dataclass
class EvalResult:
    metrics: dict[str, float]
    """Flat `eval/...` metrics of every setting."""
    episodes: dict[str, dict[str, list[float]]]
    """Per setting label ("" as trained), per metric (`reward/mean`, `episode/KEY` that every episode reports),
    each episode's value in a fixed order: what `compare` pairs."""
    samples: list[int]
    """Each episode's held-out sample, in that order: the clusters `compare` takes its interval over."""
    transcripts: list[dict[str, Any]] = field(default_factory=list)
    """The first `eval.transcripts` episodes of each setting, whole, with their `setting` label ("" as trained)."""


class Evaluation:
    """The held-out set and the settings of one run's evaluations."""

    def __init__(self, config: RunConfig, training_samples: list[dict[str, Any]], listed: dict[str, int] | None = None):
        """`listed`: the environment's own attempts (role -> k), which `roles.attempts` and `eval.attempts` override."""
        self.config, self.eval = config, config.eval
        self.attempts = {**config.roles.attempts, **self.eval.attempts}  # over each evaluation environment's own
        tries = {**(listed or {}), **self.attempts}
        for k in self.eval.pass_k:
            if k > self.eval.episodes_per_sample and k > max(tries.values(), default=0):
                most, fix = "", "raise episodes_per_sample or drop k"
                if tries:
                    most = f" or a role's attempts ({', '.join(f'{r} {n}' for r, n in tries.items())})"
                    fix = "raise episodes_per_sample or eval.attempts, or drop k"
                raise ConfigError(f"eval.pass_k: k={k} needs 1 <= k <= eval.episodes_per_sample "
                                  f"({self.eval.episodes_per_sample}){most}; {fix}")
        self.greedy_attempts = sorted(role for role, k in tries.items() if k > 1)
        samples = load_samples(self.eval.data, key="eval.data")
        self.samples = samples[:self.eval.max_samples] if self.eval.max_samples else samples
        seen = {_row_key(row) for row in training_samples}
        overlap = [row for row in self.samples if _row_key(row) in seen]
        if overlap:
            raise ConfigError(f"eval.data: {len(overlap)} of its {len(self.samples)} samples are training samples too "
                              f"(first: {json.dumps(overlap[0], default=str)[:120]}); hold them out of data")
        self.make_env = rollout.env_factory(config.environment.name,
                                            {**config.environment.kwargs, **self.eval.environment_kwargs})
        self.seed = config.train.seed if self.eval.seed is None else self.eval.seed

    def greedy_copies(self) -> str | None:
        """A warning when greedy evaluation plays several episodes per sample: copies, unless the environment
        draws at random (the standard errors are per sample, so copies only cost time)."""
        roles = self.config.roles
        seatings = len({tuple(sorted(s.items())) for s in roles.seatings()}) if roles.rotation == "per_episode" else 1
        if self.eval.temperature == 0 and self.greedy_attempts:
            role = self.greedy_attempts[0]
            return (f"eval.temperature 0 with attempts ({role}): greedy decoding plays copies of each prompt's "
                    f"attempts (their pass@k then equals pass@1); set eval.temperature above 0, or eval.attempts: "
                    f"{{{role}: 1}}")
        if self.eval.temperature > 0 or self.eval.episodes_per_sample <= seatings:
            return None
        return (f"eval.episodes_per_sample is {self.eval.episodes_per_sample} at eval.temperature 0: greedy decoding "
                f"plays copies of each sample's {seatings} distinct episode(s) unless the environment draws at random "
                f"(pass@k then equals pass@1); set eval.temperature above 0, or eval.episodes_per_sample: {seatings}")

    def due(self, step: int) -> bool:
        """Before the first step, after the last, and every `eval.every` steps."""
        every = self.eval.every
        return step == 0 or step == self.config.train.steps or bool(every and step % every == 0)

    def run(self, generate, assignment, *, initial: bool = False) -> EvalResult:
        """Play every setting; `generate(prompts, seed, temperature)` is the coordinator's. Every setting plays
        the same seeds (common random numbers), so with `initial` (every agent at its initial weights) a partner
        setting that only holds agents at `initial` is the trained setting itself: its episodes are reused."""
        metrics, values, samples, transcripts = {}, {}, [], []
        settings = {"": {}, **self.eval.partners}
        played: list[rollout.Episode] = []
        for label, held in settings.items():
            if label and initial and set(held.values()) == {"initial"}:
                episodes = played
            else:
                episodes = rollout.play(self.make_env, self.samples, self.eval.episodes_per_sample,
                                        _seated(assignment, held, label),
                                        lambda prompts, seed: generate(prompts, seed, self.eval.temperature),
                                        seed=rollout.derive_seed(self.seed, "eval", ""), first_episode=0,
                                        attempts=self.attempts)
            if not label:
                played = episodes
            prefix = f"eval/{label}/" if label else "eval/"
            metrics.update({prefix + k: v for k, v in summarise(episodes, self.eval.pass_k).items()})
            values[label] = per_episode(episodes)
            samples = [e.sample_index for e in episodes]
            transcripts += [{"setting": label, **e.transcript()} for e in episodes[:self.eval.transcripts]]
        return EvalResult(metrics, values, samples, transcripts)


def _seated(assignment, held: dict[str, str], label: str):
    """The run's seating with the held agents swapped for their partner trainer or the scripted player."""
    swap = {agent: rollout.SCRIPTED if weights == "scripted" else f"{agent}{PARTNER}{label}"
            for agent, weights in held.items()}

    def seats(episode: int, turn: int) -> dict[str, str]:
        return {role: swap.get(agent, agent) for role, agent in assignment(episode, turn).items()}

    return seats


def _row_key(row: dict[str, Any]) -> str:
    return json.dumps(row, sort_keys=True, default=str)


def shared_reward(episode: rollout.Episode) -> float:
    total = episode.total_reward()
    return statistics.fmean(total.values()) if isinstance(total, dict) else total


def per_episode(episodes: list[rollout.Episode]) -> dict[str, list[float]]:
    """Each episode's shared reward and every episode_info entry all episodes report, in episode order."""
    out = {"reward/mean": [shared_reward(e) for e in episodes]}
    for key in sorted(set.intersection(*(set(e.info) for e in episodes)) if episodes else ()):
        out[f"episode/{key}"] = [float(e.info[key]) for e in episodes]
    return out


def summarise(episodes: list[rollout.Episode], pass_k: list[int]) -> dict[str, float]:
    """Means with standard errors of the shared reward, per-role rewards and episode_info entries; pass@k."""
    out = {"episodes": float(len(episodes))}
    series = {"reward/mean": [(e.sample_index, shared_reward(e)) for e in episodes]}
    for role in sorted({r for e in episodes if isinstance(e.total_reward(), dict) for r in e.total_reward()}):
        series[f"reward/{role}"] = [(e.sample_index, e.total_reward()[role]) for e in episodes]
    for key in sorted({k for e in episodes for k in e.info}):
        series[f"episode/{key}"] = [(e.sample_index, float(e.info[key])) for e in episodes if key in e.info]
    for name, pairs in series.items():
        values, samples = [v for _, v in pairs], [s for s, _ in pairs]
        out[name] = sample_mean(values, samples)
        out[f"{name}/stderr"] = stderr(per_sample_means(values, samples))
    if pass_k and any("success" in e.info for e in episodes):
        per_sample: dict[int, list[float]] = {}
        for e in episodes:
            per_sample.setdefault(e.sample_index, []).append(float(e.info.get("success", 0.0)))
        for k in pass_k:
            if k > min(len(s) for s in per_sample.values()):
                continue  # fewer episodes than k (k is for attempts)
            values = [pass_at_k(len(s), int(round(sum(s))), k) for s in per_sample.values()]
            out[f"pass@{k}"], out[f"pass@{k}/stderr"] = statistics.fmean(values), stderr(values)
    for role, prompts in attempt_successes(episodes).items():
        for k in pass_k:
            if k > min(len(tries) for _, tries in prompts):
                continue  # fewer attempts than k (k is for episodes or another role)
            values, samples = [pass_at_k(len(tries), int(round(sum(tries))), k) for _, tries in prompts], \
                [sample for sample, _ in prompts]
            out[f"pass@{k}/{role}"] = sample_mean(values, samples)  # each sample weighs the same, as its stderr says
            out[f"pass@{k}/{role}/stderr"] = stderr(per_sample_means(values, samples))
    return out


def attempt_successes(episodes: list[rollout.Episode]) -> dict[str, list[tuple[int, list[float]]]]:
    """Per attempts role whose attempts report `success` anywhere: (sample, each attempt's success) of every prompt
    it answered (an attempt that reports none counts 0)."""
    found: dict[str, list[tuple[int, list[float]]]] = {}
    reported = set()
    for e in episodes:
        for turn in e.turns:
            prompts: dict[str, list[float]] = {}
            for action in turn.actions:
                if action.attempt is not None:
                    info = turn.info_of(action)
                    prompts.setdefault(action.role, []).append(float(info.get("success", 0.0)))
                    if "success" in info:
                        reported.add(action.role)
            for role, tries in prompts.items():
                found.setdefault(role, []).append((e.sample_index, tries))
    return {role: prompts for role, prompts in found.items() if role in reported}


def per_sample_means(values: list[float], samples: list[int]) -> list[float]:
    """The mean of each sample's values (`samples[i]` is the sample of `values[i]`), in order of first appearance."""
    return [statistics.fmean(v) for v in _grouped(values, samples).values()]


def sample_mean(values: list[float], samples: list[int]) -> float:
    """The mean of the per-sample means: every sample weighs the same. With as many values of each sample it is
    the plain mean, and is computed as that (so the figure is the episode mean to the last bit)."""
    sizes = {len(v) for v in _grouped(values, samples).values()}
    return statistics.fmean(values) if len(sizes) == 1 else statistics.fmean(per_sample_means(values, samples))


def _grouped(values: list[float], samples: list[int]) -> dict[int, list[float]]:
    grouped: dict[int, list[float]] = {}
    for value, sample in zip(values, samples, strict=True):
        grouped.setdefault(sample, []).append(value)
    return grouped


def stderr(values: list[float]) -> float:
    """Standard error of the mean (sample standard deviation / sqrt(n)); 0 for fewer than two values."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one sample with n attempts, c of them successes (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


# two-sided 95% quantiles of Student's t for 1..30 degrees of freedom; the normal's 1.96 beyond
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def compare(before: list[float], after: list[float], samples: list[int] | None = None) -> dict[str, float | bool]:
    """Paired difference of two evaluations of the same episodes (same samples and seeds). `before` and `after` are
    each side's mean of per-sample means (`sample_mean`), `difference` is after - before (the mean of the per-sample
    differences), with a 95% confidence interval (Student's t) over the per-sample differences, and whether it
    excludes 0. `samples[i]` is episode i's sample (None: every episode a sample of its own), so copies of an
    episode add no confidence and a sample with more episodes weighs no more."""
    if len(before) != len(after) or not before:
        raise ValueError(f"compare needs the same episodes on both sides, got {len(before)} and {len(after)}")
    samples = list(range(len(before))) if samples is None else samples
    diffs = per_sample_means([b - a for a, b in zip(before, after)], samples)
    mean_before, mean_after = sample_mean(before, samples), sample_mean(after, samples)
    difference, se = mean_after - mean_before, stderr(diffs)
    if len(diffs) < 2:  # one pair says nothing about noise
        low, high = -math.inf, math.inf
    else:
        t = _T95[len(diffs) - 2] if len(diffs) <= 31 else 1.96
        low, high = difference - t * se, difference + t * se
    return {"before": mean_before, "after": mean_after, "difference": difference,
            "low": low, "high": high, "episodes": len(before), "samples": len(diffs),
            "distinguishable": low > 0 or high < 0}
