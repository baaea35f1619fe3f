"""`marsi plot`: a run's curves as PNG files in its directory.

    RUN_DIR/plot.png     every panel below, two to a row
    RUN_DIR/reward.png   the reward panel alone
    RUN_DIR/loss.png     the loss panel alone

Panels: the shared reward (mean with a +-1 std band, and each role's reward in zero-sum games); each
agent's loss; each `episode/*` metric, with `turns/mean` and `invalid_rate`; the `eval/*` metrics, one
panel per group (`eval/reward/mean` and `eval/reward/ROLE` share `eval/reward`), with error bars where
a `KEY/stderr` is logged beside `KEY`. The x axis is the step, with integer ticks.

Training curves are drawn from the training rows; a row that holds only `eval/` metrics (an evaluation
logged as a row of its own) feeds the eval panels alone. A training curve has a gap, not a line, across
steps without a value. An agent's loss has a value only at the steps it trained (the row's `trained`
list), so an agent that sits out steps (alternating schedules) is drawn as separate segments or points.
Eval metrics, logged every few steps, are joined from one evaluation to the next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.runlog import read_jsonl

_EPISODE_KEYS = ("turns/mean", "invalid_rate")


@dataclass
class Series:
    """One curve: `values[i]` at `steps[i]`; NaN draws a gap."""

    label: str
    steps: list[int]
    values: list[float]
    errors: list[float] | None = None  # +- this much, drawn as error bars


@dataclass
class Panel:
    title: str
    ylabel: str
    series: list[Series] = field(default_factory=list)
    band: tuple[list[int], list[float], list[float]] | None = None  # (steps, low, high), shaded


def _number(value: Any) -> float:
    """A finite number as float, anything else (missing, None, NaN, text) as NaN."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return math.nan


def per_step(rows: list[dict[str, Any]], key: str, label: str | None = None) -> Series:
    """`key` at every step; NaN (a gap) at steps without it."""
    return Series(label or key, [r["step"] for r in rows], [_number(r.get(key)) for r in rows])


def agent_series(rows: list[dict[str, Any]], key: str, agent: str) -> Series:
    """`key` of `agent` at the steps it trained; NaN at the others, so no line bridges them."""
    steps = [r["step"] for r in rows]
    values = [_number(r.get(key)) if agent in r.get("trained", [agent]) else math.nan for r in rows]
    return Series(agent, steps, values)


def sparse(rows: list[dict[str, Any]], key: str, label: str) -> Series:
    """`key` at the steps that logged it, joined from one to the next, with `key/stderr` as its error bars
    when logged (eval metrics)."""
    picked = [r for r in rows if key in r]
    errors = [_number(r.get(f"{key}/stderr")) for r in picked]
    return Series(label, [r["step"] for r in picked], [_number(r[key]) for r in picked],
                  errors if any(not math.isnan(e) for e in errors) else None)


def _training_row(row: dict[str, Any]) -> bool:
    """Whether a row holds training metrics: anything besides `step` and `eval/` keys."""
    return any(k != "step" and not k.startswith("eval/") for k in row)


def _eval_value_key(key: str) -> bool:
    """An `eval/` key to draw: not a standard error (drawn as error bars) nor an episode count."""
    return key.startswith("eval/") and not key.endswith(("/stderr", "/episodes"))


def _keys(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith(prefix)})


def reward_panel(rows: list[dict[str, Any]]) -> Panel:
    mean = per_step(rows, "reward/mean", "mean")
    std = per_step(rows, "reward/std").values
    band = (mean.steps, [m - s for m, s in zip(mean.values, std)], [m + s for m, s in zip(mean.values, std)])
    roles = [per_step(rows, k, k.removeprefix("reward/")) for k in _keys(rows, "reward/")
             if k not in ("reward/mean", "reward/std")]
    return Panel("reward (shared mean +- std; per role)", "reward", [mean, *roles], band)


def loss_panel(rows: list[dict[str, Any]]) -> Panel:
    agents = [k.removeprefix("loss/") for k in _keys(rows, "loss/")]
    return Panel("loss per agent (at the steps it trained)", "loss",
                 [agent_series(rows, f"loss/{a}", a) for a in agents])


def panels(rows: list[dict[str, Any]]) -> list[Panel]:
    """Every panel of a run's metrics rows, in drawing order."""
    training = [r for r in rows if _training_row(r)]
    found = [reward_panel(training), loss_panel(training)]
    for key in [*_keys(training, "episode/"), *(k for k in _EPISODE_KEYS if any(k in r for r in training))]:
        found.append(Panel(key, key.removeprefix("episode/"), [per_step(training, key, key)]))
    groups: dict[str, list[str]] = {}
    for key in filter(_eval_value_key, _keys(rows, "eval/")):
        groups.setdefault(key.rsplit("/", 1)[0] if key.count("/") > 1 else key, []).append(key)
    for group, keys in groups.items():
        found.append(Panel(group, group.removeprefix("eval/"),
                           [sparse(rows, k, k.removeprefix(group + "/")) for k in keys]))
    return found


def draw(ax, panel: Panel) -> None:
    """One panel on a matplotlib Axes: labelled axes, integer step ticks, a legend when there are curves."""
    from matplotlib.ticker import MaxNLocator

    if panel.band is not None:
        ax.fill_between(*panel.band, alpha=0.2, linewidth=0)
    for s in panel.series:
        if s.errors is None:
            ax.plot(s.steps, s.values, marker=".", markersize=3, linewidth=1, label=s.label)
        else:
            ax.errorbar(s.steps, s.values, yerr=s.errors, marker=".", markersize=3, linewidth=1, capsize=2,
                        label=s.label)
    ax.set_title(panel.title)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if len(panel.series) > 1 or any(s.label != panel.title for s in panel.series):
        ax.legend(fontsize="small")


def figure(found: list[Panel], columns: int = 2):
    """A figure holding `found`, `columns` to a row."""
    import matplotlib.pyplot as plt

    rows = math.ceil(len(found) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, found):
        draw(ax, panel)
    for ax in axes.flat[len(found):]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig


def plot(run_dir: str | Path) -> list[Path]:
    """Write plot.png, reward.png and loss.png into `run_dir`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    if not rows:
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl rows to plot; is this a run directory?")
    found = panels(rows)
    written = []
    for name, chosen, columns in (("plot.png", found, 2), ("reward.png", found[:1], 1), ("loss.png", found[1:2], 1)):
        fig = figure(chosen, columns)
        fig.savefig(run_dir / name, dpi=100)
        plt.close(fig)
        written.append(run_dir / name)
    return written
