"""`marsi plot`: which curves, with gaps where an agent did not train, on labelled axes with integer steps."""

from __future__ import annotations

import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from orchestrator.plot import agent_series, figure, flat_notes, panels, plot  # noqa: E402


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


def test_panels_show_training_metrics_that_vary_and_leave_out_constant_ones():
    rows = alternating_rows()
    for step, row in enumerate(rows, 1):
        agent = row["trained"][0]
        row.update({f"entropy/{agent}": 2.0 - step / 10, f"kl/{agent}": 0.0, f"grad_norm/{agent}": step / 3,
                    f"clip_fraction/{agent}": 0.0, f"rollout/logp_gap/{agent}": 1e-3 * step,
                    "groups/zero_variance/a": step / 8, "groups/zero_variance/b": 1.0})
    found = by_title(panels(rows))
    assert list(found) == ["shared reward", "reward per role", "entropy per agent", "grad norm per agent",
                           "log-prob gap, learner vs sampling engine, per agent",
                           "share of groups with equal returns", "loss per agent", "episode/hits", "eval/reward"]
    # KL and clip fraction are 0 throughout, turns/mean and invalid_rate constant: no panel of their own
    assert [s.label for s in found["reward per role"].series] == ["o", "x"]
    assert [s.label for s in found["entropy per agent"].series] == ["a", "b"]
    share = {s.label: s for s in found["share of groups with equal returns"].series}
    assert share["a"].values == [step / 8 for step in range(1, 9)]  # logged every step, trained or not
    evals = {s.label: s for s in found["eval/reward"].series}
    assert evals["mean"].steps == [4, 8] and evals["mean"].values == [0.2, 0.4]  # joined from eval to eval
    assert evals["x"].steps == [4, 8]


def test_a_stalled_run_keeps_its_reward_panel_and_names_its_constant_curves():
    """A run stuck at reward 0: every group flat, nothing invalid, nothing learned. The reward panel is drawn all the
    same (flat at 0), and each constant curve is named with its value in one line per panel, under the figure."""
    rows = [{"step": s, "trained": ["a", "b"], "reward/mean": 0.0, "reward/std": 0.0, "reward/min": 0.0,
             "reward/max": 0.0, "invalid_rate": 0.0, "turns/mean": 2.0, "groups/zero_variance/a": 1.0,
             "groups/zero_variance/b": 1.0, "loss/a": 0.0, "loss/b": 0.0} for s in range(1, 6)]
    found = panels(rows)
    assert [p.title.split(" (")[0] for p in found] == ["shared reward"]
    assert found[0].series[0].raw == [0.0] * 5
    assert flat_notes(rows) == ["share of groups with equal returns (no gradient) per agent: a 1, b 1",
                                "loss per agent: a 0, b 0", "invalid_rate: 0", "turns/mean: 2"]
    several = flat_notes({"one": rows, "two": rows})
    assert several[0] == "share of groups with equal returns (no gradient) per agent: one: a 1, one: b 1, two: a 1, two: b 1"
    fig = figure(found, 2, flat_notes(rows))
    try:
        said = "\n".join(t.get_text() for t in fig.texts)
        assert "Constant over the run (no panel):" in said and "invalid_rate: 0" in said
    finally:
        plt.close(fig)


def test_the_reward_is_smoothed_over_the_raw_one_and_its_band_stays_within_the_steps_rewards():
    rows = [{"step": s, "trained": ["a"], "reward/mean": m, "reward/std": 0.3, "reward/min": 0.0, "reward/max": 1.0,
             "loss/a": 0.0} for s, m in enumerate([0.1, 0.9, 0.1, 0.9, 0.2], 1)]
    reward = panels(rows, smoothing=0.5)[0].series[0]
    assert reward.raw == [0.1, 0.9, 0.1, 0.9, 0.2]
    # debiased EMA, weight 0.5: a = 0.05, then 0.5 * 0.05 + 0.45, divided by 1 - 0.5 ** 2
    assert math.isclose(reward.values[0], 0.1) and math.isclose(reward.values[1], 0.475 / 0.75)
    assert max(reward.values) - min(reward.values) < 0.9 - 0.1  # smoother than the raw curve
    low, high = reward.band
    assert low[0] == 0.0 and low[1] == 0.9 - 0.3  # 0.1 - 0.3 is clipped to the step's lowest reward, 0
    assert high[1] == 1.0 and high[0] == 0.1 + 0.3  # 0.9 + 0.3 is clipped to its highest, 1
    assert len(panels(rows)) == 1  # a loss of 0 at every step says nothing: no panel


def test_several_runs_are_overlaid_each_curve_its_own_colour():
    one, two = alternating_rows(), alternating_rows()
    for row in two:
        row["reward/mean"] += 0.5
    found = by_title(panels({"first": one, "second": two}))
    reward = found["shared reward"].series
    assert [s.label for s in reward] == ["first: mean", "second: mean"]
    assert reward[1].raw == [r["reward/mean"] for r in two]
    assert len({s.color for s in found["loss per agent"].series}) == 4  # a and b of each run


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


def test_plot_writes_the_figures_of_several_runs_and_reads_rows_without_trained(tmp_path):
    rows = alternating_rows()
    for row in rows[:2]:
        del row["trained"]  # rows of older runs: every logged loss is drawn
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    written = plot([tmp_path / "one", tmp_path / "two"], out=tmp_path / "out")
    assert [p.name for p in written] == ["plot.png", "reward.png"]
    for path in written:
        assert path.parent == tmp_path / "out" and path.read_bytes()[:4] == b"\x89PNG"
    assert same(agent_series(rows, "loss/a", "a").values[:2], [1.0, 0.5])


def test_evaluation_rows_of_their_own_feed_only_the_eval_panels():
    rows = [{k: v for k, v in r.items() if not k.startswith("eval/")} for r in alternating_rows(4)]
    for step in (0, 2, 4):  # an evaluation before the first step and every 2 steps, each a row of its own
        rows.append({"step": step, "eval/reward/mean": step / 4, "eval/reward/mean/stderr": 0.05,
                     "eval/episodes": 16, "eval/pass@2": 0.5, "eval/pass@2/stderr": 0.1})
    rows.sort(key=lambda r: r["step"])
    found = by_title(panels(rows))
    mean = found["shared reward"].series[0]
    assert mean.steps == [1, 2, 3, 4] and not any(math.isnan(v) for v in mean.raw)  # no gap at eval rows
    assert found["loss per agent"].series[0].steps == [1, 2, 3, 4]
    evals = found["eval/reward"].series[0]
    assert (evals.label, evals.steps, evals.values) == ("mean", [0, 2, 4], [0.0, 0.5, 1.0])
    assert [round(e, 6) for e in evals.errors] == [0.098] * 3  # 95% confidence: 1.96 standard errors
    assert [round(e, 6) for e in found["eval/pass@2"].series[0].errors] == [0.196] * 3
    assert not any("episodes" in title or "stderr" in title for title in found)
    fig = figure(list(found.values()))
    plt.close(fig)
