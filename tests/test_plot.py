"""`marsi plot`: which curves, with gaps where an agent did not train, on labelled axes with integer steps."""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from orchestrator.plot import agent_series, figure, panels, plot  # noqa: E402


def alternating_rows(steps: int = 8) -> list[dict]:
    """a trains at steps 1-2, b at 3-4, a at 5-6, ...; eval every 4 steps; a zero-sum pair of roles."""
    rows = []
    for step in range(1, steps + 1):
        agent = "a" if (step - 1) // 2 % 2 == 0 else "b"
        row = {"step": step, "trained": [agent], "reward/mean": step / 10, "reward/std": 0.1,
               "reward/x": step / 10, "reward/o": -step / 10, f"loss/{agent}": 1.0 / step,
               "episode/hits": float(step), "turns/mean": 2.0, "invalid_rate": 0.0}
        if step % 4 == 0:
            row.update({"eval/reward/mean": step / 20, "eval/reward/x": step / 30})
        rows.append(row)
    return rows


def by_title(found):
    return {p.title.split(" (")[0]: p for p in found}


def same(xs, ys):
    return len(xs) == len(ys) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(xs, ys))


def test_an_agents_loss_has_a_gap_where_it_did_not_train():
    rows = alternating_rows()
    a = agent_series(rows, "loss/a", "a")
    b = agent_series(rows, "loss/b", "b")
    nan = math.nan
    assert a.steps == b.steps == list(range(1, 9))
    assert same(a.values, [1.0, 0.5, nan, nan, 0.2, 1 / 6, nan, nan])
    assert same(b.values, [nan, nan, 1 / 3, 0.25, nan, nan, 1 / 7, 0.125])
    # a value logged for an agent at a step it did not train is not drawn either
    rows[2]["loss/a"] = 9.0
    assert math.isnan(agent_series(rows, "loss/a", "a").values[2])


def test_panels_cover_reward_loss_episode_and_eval_metrics():
    found = by_title(panels(alternating_rows()))
    assert list(found) == ["reward", "loss per agent", "episode/hits", "turns/mean", "invalid_rate", "eval/reward"]
    assert [s.label for s in found["reward"].series] == ["mean", "o", "x"]
    assert found["reward"].band is not None
    assert [s.label for s in found["loss per agent"].series] == ["a", "b"]
    evals = {s.label: s for s in found["eval/reward"].series}
    assert evals["mean"].steps == [4, 8] and evals["mean"].values == [0.2, 0.4]  # joined from eval to eval
    assert evals["x"].steps == [4, 8]


def test_the_figure_has_labelled_axes_integer_steps_and_broken_loss_lines():
    found = panels(alternating_rows())
    fig = figure(found)
    try:
        axes = [ax for ax in fig.axes if ax.get_visible()]
        assert len(axes) == len(found)
        for ax in axes:
            assert ax.get_xlabel() == "step" and ax.get_ylabel() and ax.get_title()
            locator = ax.xaxis.get_major_locator()
            assert isinstance(locator, MaxNLocator) and locator._integer
        loss = next(ax for ax in axes if ax.get_title().startswith("loss"))
        lines = {line.get_label(): line for line in loss.get_lines()}
        ydata = [float(y) for y in lines["a"].get_ydata()]
        assert [math.isnan(y) for y in ydata] == [False, False, True, True, False, False, True, True]
        fig.canvas.draw()
        ticks = [t for t in loss.get_xticks() if loss.get_xlim()[0] <= t <= loss.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    finally:
        plt.close(fig)


def test_plot_writes_the_figure_and_reads_rows_without_trained(tmp_path):
    rows = alternating_rows()
    for row in rows[:2]:
        del row["trained"]  # rows of older runs: every logged loss is drawn
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot(tmp_path)
    assert [p.name for p in written] == ["plot.png", "reward.png", "loss.png"]
    for path in written:
        assert path.read_bytes()[:4] == b"\x89PNG"
    assert same(agent_series(rows, "loss/a", "a").values[:2], [1.0, 0.5])


def test_evaluation_rows_of_their_own_feed_only_the_eval_panels():
    rows = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in alternating_rows(4)]
    for step in (0, 2, 4):  # an evaluation before the first step and every 2 steps, each a row of its own
        rows.append({"step": step, "eval/reward/mean": step / 4, "eval/reward/mean/stderr": 0.05,
                     "eval/episodes": 16, "eval/pass@2": 0.5, "eval/pass@2/stderr": 0.1})
    rows.sort(key=lambda r: r["step"])
    found = by_title(panels(rows))
    mean = found["reward"].series[0]
    assert mean.steps == [1, 2, 3, 4] and not any(math.isnan(v) for v in mean.values)  # no gap at eval rows
    assert found["loss per agent"].series[0].steps == [1, 2, 3, 4]
    evals = found["eval/reward"].series[0]
    assert (evals.label, evals.steps, evals.values, evals.errors) == ("mean", [0, 2, 4], [0.0, 0.5, 1.0],
                                                                     [0.05, 0.05, 0.05])
    assert found["eval/pass@2"].series[0].errors == [0.1, 0.1, 0.1]
    assert not any("episodes" in title or "stderr" in title for title in found)
    fig = figure(list(found.values()))
    plt.close(fig)
