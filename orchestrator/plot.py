"""The curves of one or more runs: the panels `marsi plot` draws as PNG files and `marsi report` as interactive
charts (orchestrator/report.py).

    marsi plot RUN [RUN ...]   ->  plot.png (every panel, two to a row) and reward.png (the reward panel alone),
                                   in the first run's directory or --out DIR

Panels, in drawing order. The reward panel is always drawn (a run stuck at 0 shows it flat); any other training
panel only when one of its curves varies: a constant `turns/mean`, `invalid_rate` or zero-variance share, or a
loss that is 0 at every step, gets no panel but a line of `flat_notes` (each curve's value), printed under the
figure and the report's curves:

- reward: the shared reward per step, raw (thin) under its smoothed curve (bold: an exponential moving
  average, `smoothing` its weight, debiased at the start as TensorBoard's); a +-1 std band clipped to the
  step's lowest and highest episode reward (`reward/min`, `reward/max`), so a reward in [0, 1] never shows
  a band below 0;
- reward per role (games with a reward per role), smoothed likewise;
- per agent: entropy, KL to the reference, grad norm, clip fraction, log-prob gap (`rollout/logp_gap/A`:
  the learner's log-probs against the engine's that sampled), the share of groups with equal returns
  (`groups/zero_variance/A`: no gradient), completion length, loss. An update metric has a value only at
  the steps its agent trained (the row's `trained` list): an agent that sits out steps is drawn as segments;
- each `episode/*` metric, `invalid_rate`, `turns/mean`;
- the `eval/*` metrics, one panel per group (`eval/reward/mean` and `eval/reward/ROLE` share `eval/reward`),
  joined from one evaluation to the next, with 95% confidence bars (1.96 x `KEY/stderr`, which evaluation
  clusters per sample) where logged.

Several runs are overlaid: every curve once per run, labelled `RUN: label`. A row that holds only `eval/`
metrics (an evaluation logged as a row of its own) feeds the eval panels alone. The x axis is the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.runfiles import read_records

SMOOTHING = 0.6
"""Default weight of the exponential moving average drawn over the raw reward."""
CONFIDENCE = 1.96  # 95% (normal) confidence bars from a standard error

AGENT_METRICS = [  # (key prefix, title, lower bound, upper bound, only at the steps the agent trained)
    ("entropy/", "entropy per agent", 0.0, None, True),
    ("kl/", "KL to the reference per agent", None, None, True),
    ("grad_norm/", "grad norm per agent (before clipping)", 0.0, None, True),
    ("clip_fraction/", "clip fraction per agent", 0.0, 1.0, True),
    ("rollout/logp_gap/", "log-prob gap, learner vs sampling engine, per agent", 0.0, None, True),
    ("groups/zero_variance/", "share of groups with equal returns (no gradient) per agent", 0.0, 1.0, False),
    ("completion_length/", "completion length per agent (tokens)", 0.0, None, False),
    ("loss/", "loss per agent", None, None, True),
    ("memory/peak_mib/", "peak resident memory per process (MiB; members sharing one joined by +)", 0.0, None, False),
    ("memory/device_peak_mib/", "peak GPU memory per process (MiB)", 0.0, None, False),
]
_EPISODE_KEYS = ("invalid_rate", "turns/mean")


@dataclass
class Series:
    """One curve: `values[i]` at `steps[i]`; NaN draws a gap."""

    label: str
    steps: list[int]
    values: list[float]
    errors: list[float] | None = None
    """+- this much at each point (95% confidence), drawn as error bars."""
    band: tuple[list[float], list[float]] | None = None
    """(low, high) at each step, shaded."""
    raw: list[float] | None = None
    """The unsmoothed values, drawn thin under `values`."""
    color: int = 0
    """Index into the palette: a curve keeps its colour across its raw line, band and smoothed line."""


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    bounds: tuple[float | None, float | None] = (None, None)
    """The metric's own bounds (a share lies in [0, 1]); bands and bars are clipped to them."""
    always: bool = False
    """Drawn even when no curve varies (the reward, an evaluation)."""


def _number(value: Any) -> float:
    """A finite number as float, anything else (missing, None, NaN, text) as NaN."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return math.nan


def smooth(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Exponential moving average of `values` (weight on the past), debiased at the start; NaN stays a gap
    and is skipped by the average."""
    out, average, n = [], 0.0, 0
    for value in values:
        if math.isnan(value):
            out.append(math.nan)
            continue
        n += 1
        average = weight * average + (1.0 - weight) * value
        out.append(average / (1.0 - weight ** n) if weight < 1.0 else value)
    return out


def clip(values: list[float], low: float | None, high: float | None) -> list[float]:
    return [min(max(v, low if low is not None else v), high if high is not None else v) for v in values]


def per_step(rows: list[dict[str, Any]], key: str, label: str | None = None) -> Series:
    """`key` at every step; NaN (a gap) at steps without it."""
    return Series(label or key, [r["step"] for r in rows], [_number(r.get(key)) for r in rows])


def agent_series(rows: list[dict[str, Any]], key: str, agent: str) -> Series:
    """`key` of `agent` at the steps it trained; NaN at the others, so no line bridges them."""
    steps = [r["step"] for r in rows]
    values = [_number(r.get(key)) if agent in r.get("trained", [agent]) else math.nan for r in rows]
    return Series(agent, steps, values)


def sparse(rows: list[dict[str, Any]], key: str, label: str) -> Series:
    """`key` at the steps that logged it, joined from one to the next, with 95% confidence bars from
    `key/stderr` when logged (eval metrics)."""
    picked = [r for r in rows if key in r]
    errors = [CONFIDENCE * _number(r.get(f"{key}/stderr")) for r in picked]
    return Series(label, [r["step"] for r in picked], [_number(r[key]) for r in picked],
                  errors if any(not math.isnan(e) for e in errors) else None)


def _training_row(row: dict[str, Any]) -> bool:
    """Whether a row holds training metrics: anything besides `step` and `eval/` keys."""
    return any(k != "step" and not k.startswith("eval/") for k in row)


def _eval_value_key(key: str) -> bool:
    """An `eval/` key to draw: not a standard error (drawn as error bars) nor an episode count."""
    return key.startswith("eval/") and not key.endswith(("/stderr", "/episodes")) and key != "eval/episodes"


def _keys(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix) and "/" not in k[len(prefix):]})


def smoothed(series: Series, weight: float) -> Series:
    """`series` drawn smoothed over its raw values."""
    series.raw, series.values = series.values, smooth(series.values, weight)
    return series


def reward_panel(rows: list[dict[str, Any]], weight: float = SMOOTHING) -> Panel:
    mean = per_step(rows, "reward/mean", "mean")
    std = per_step(rows, "reward/std").values
    low = [max(m - s, lo) if not math.isnan(lo) else m - s
           for m, s, lo in zip(mean.values, std, per_step(rows, "reward/min").values)]
    high = [min(m + s, hi) if not math.isnan(hi) else m + s
            for m, s, hi in zip(mean.values, std, per_step(rows, "reward/max").values)]
    mean.band = (low, high)
    return Panel(f"shared reward (mean, smoothed {weight:g}; band +-1 std within the step's range)", "reward",
                 [smoothed(mean, weight)], always=True)


def role_panel(rows: list[dict[str, Any]], weight: float = SMOOTHING) -> Panel:
    roles = [k for k in _keys(rows, "reward/") if k not in ("reward/mean", "reward/std", "reward/min", "reward/max")]
    return Panel(f"reward per role (smoothed {weight:g})", "reward",
                 [smoothed(per_step(rows, k, k.removeprefix("reward/")), weight) for k in roles])


def agent_panel(rows: list[dict[str, Any]], prefix: str, title: str, low: float | None, high: float | None,
                trained_only: bool) -> Panel:
    agents = [k.removeprefix(prefix) for k in _keys(rows, prefix)]
    series = [agent_series(rows, prefix + a, a) if trained_only else per_step(rows, prefix + a, a) for a in agents]
    return Panel(title, prefix.rstrip("/").rsplit("/", 1)[-1], series, (low, high))


def run_panels(rows: list[dict[str, Any]], weight: float = SMOOTHING) -> list[Panel]:
    """Every panel of one run's metrics rows, in drawing order, before the check that a curve varies."""
    training = [r for r in rows if _training_row(r)]
    found = [reward_panel(training, weight), role_panel(training, weight)]
    found += [agent_panel(training, *spec) for spec in AGENT_METRICS]
    for key in [*_keys(training, "episode/"), *(k for k in _EPISODE_KEYS if any(k in r for r in training))]:
        found.append(Panel(key, key.removeprefix("episode/"), [per_step(training, key, key)],
                           (0.0, 1.0) if key == "invalid_rate" else (None, None)))
    groups: dict[str, list[str]] = {}
    for key in filter(_eval_value_key, sorted({k for r in rows for k in r if k.startswith("eval/")})):
        groups.setdefault(key.rsplit("/", 1)[0] if key.count("/") > 1 else key, []).append(key)
    for group, keys in groups.items():
        bounds = (0.0, 1.0) if "pass@" in group else (None, None)
        found.append(Panel(f"{group} (95% confidence bars)", group.removeprefix("eval/"),
                           [sparse(rows, k, k.removeprefix(group + "/") if k != group else k.removeprefix("eval/"))
                            for k in keys],
                           bounds, always=True))
    return found


def varies(panel: Panel) -> bool:
    """Whether some curve of `panel` takes more than one value."""
    for s in panel.series:
        finite = [v for v in (s.raw or s.values) if not math.isnan(v)]
        if finite and max(finite) - min(finite) > 1e-12:
            return True
    return False


def _merged(runs: dict[str, list[dict[str, Any]]] | list[dict[str, Any]], smoothing: float) -> list[Panel]:
    """Every panel of one run's rows, or of several runs (name -> rows) overlaid: curves labelled `RUN: label`."""
    runs = {"": runs} if isinstance(runs, list) else runs
    merged: dict[str, Panel] = {}
    for name, rows in runs.items():
        for panel in run_panels(rows, smoothing):
            into = merged.setdefault(panel.title, Panel(panel.title, panel.ylabel, [], panel.bounds, panel.always))
            for s in panel.series:
                s.label = f"{name}: {s.label}" if len(runs) > 1 else s.label
                into.series.append(s)
    return [p for p in merged.values() if any(not math.isnan(v) for s in p.series for v in s.raw or s.values)]


def panels(runs: dict[str, list[dict[str, Any]]] | list[dict[str, Any]], smoothing: float = SMOOTHING) -> list[Panel]:
    """The panels to draw of one run's rows, or of several runs (name -> rows) overlaid, each curve of each run its
    own colour: the reward and evaluation panels, and every other panel with a curve that varies."""
    found = [p for p in _merged(runs, smoothing) if p.always or varies(p)]
    for panel in found:
        for i, s in enumerate(panel.series):
            s.color = i
            if s.band is not None:
                s.band = (clip(s.band[0], *panel.bounds), clip(s.band[1], *panel.bounds))
    return found


def flat_notes(runs: dict[str, list[dict[str, Any]]] | list[dict[str, Any]]) -> list[str]:
    """One line per training panel left out because no curve of it varies: its title and each curve's value
    (`invalid_rate: 0`, `share of groups with equal returns (no gradient) per agent: a 1, b 1`)."""
    notes = []
    for panel in _merged(runs, SMOOTHING):
        if panel.always or varies(panel):
            continue
        values = [(s.label, next(v for v in s.raw or s.values if not math.isnan(v))) for s in panel.series
                  if any(not math.isnan(v) for v in s.raw or s.values)]
        cells = [f"{v:g}" if label == panel.title else f"{label} {v:g}" for label, v in values]
        notes.append(f"{panel.title}: {', '.join(cells)}")
    return notes


def draw(ax, panel: Panel) -> None:
    """One panel on a matplotlib Axes: labelled axes, integer step ticks, a legend when there are curves."""
    from matplotlib.ticker import MaxNLocator

    for s in panel.series:
        color = f"C{s.color % 10}"
        if s.band is not None:
            ax.fill_between(s.steps, *s.band, color=color, alpha=0.15, linewidth=0)
        if s.raw is not None:
            ax.plot(s.steps, s.raw, color=color, alpha=0.35, linewidth=0.8)
        if s.errors is None:
            ax.plot(s.steps, s.values, color=color, marker=".", markersize=3, linewidth=1.6 if s.raw else 1,
                    label=s.label)
        else:
            ax.errorbar(s.steps, s.values, yerr=s.errors, color=color, marker=".", markersize=3, linewidth=1,
                        capsize=2, label=s.label)
    ax.set_title(panel.title, fontsize="medium")
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(panel.series) > 1 or any(s.label != panel.title for s in panel.series):
        ax.legend(fontsize="small")


def figure(found: list[Panel], columns: int = 2, notes: list[str] | None = None):
    """A figure holding `found`, `columns` to a row, and `notes` (the constant curves) under them."""
    import textwrap

    import matplotlib.pyplot as plt

    rows = max(1, math.ceil(len(found) / columns))
    text = "\n".join(textwrap.fill(n, 60 * columns, subsequent_indent="    ")
                     for n in ["Constant over the run (no panel):", *notes]) if notes else ""
    height = 3.6 * rows + 0.17 * (text.count("\n") + 1 if text else 0)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, height), squeeze=False)
    for ax, panel in zip(axes.flat, found):
        draw(ax, panel)
    for ax in axes.flat[len(found):]:
        ax.set_visible(False)
    if text:
        fig.text(0.01, 0.005, text, fontsize="small", va="bottom", family="monospace")
    fig.tight_layout(rect=(0, (0.17 * (text.count("\n") + 1) + 0.1) / height if text else 0, 1, 1))
    return fig


def read_runs(run_dirs: list[str | Path]) -> dict[str, list[dict[str, Any]]]:
    """Each run's metrics rows by its directory's name (its path where two names collide)."""
    runs = {}
    names = [Path(d).name for d in run_dirs]
    for run_dir, name in zip(run_dirs, names):
        rows = read_records(Path(run_dir), "metrics.jsonl")  # a regular file inside the run directory only
        if not rows:
            raise FileNotFoundError(f"{run_dir}: no metrics.jsonl rows to plot; is this a run directory?")
        runs[name if names.count(name) == 1 else str(run_dir)] = rows
    return runs


def plot(run_dirs: str | Path | list[str | Path], out: str | Path | None = None,
         smoothing: float = SMOOTHING) -> list[Path]:
    """Write plot.png and reward.png into `out` (default: the first run's directory); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    runs = read_runs(run_dirs)
    found, notes = panels(runs, smoothing), flat_notes(runs)
    out = Path(out) if out is not None else Path(run_dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, chosen, columns, said in (("plot.png", found, 2, notes), ("reward.png", found[:1], 1, None)):
        fig = figure(chosen, columns, said)
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)
    return written
