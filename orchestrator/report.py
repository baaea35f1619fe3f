"""`marsi report RUN [RUN ...]`: one self-contained HTML file to read runs by, offline, from `file://`.

    RUN_DIR/report.html   (of the first run; --out PATH elsewhere)

Every asset is inlined (plotly.js, the data, the few lines of script of the episode browser); nothing is
fetched. Sections:

- curves: the panels of orchestrator/plot.py (team reward smoothed over the raw one, per-agent entropy, KL,
  grad norm, clip fraction, log-prob gap, zero-variance share, evaluation with 95% confidence bars), drawn
  with Plotly, several runs overlaid; the reward panel always, and each constant curve named with its value in
  one line under them (`plot.flat_notes`);
- evaluation: a table per run of every evaluation (step 0 is the initial weights; `marsi eval` results from
  eval.jsonl by checkpoint name), each metric as mean +- 95% confidence, as trained and per partner setting;
- episodes: the training transcripts (transcripts.jsonl) and evaluation transcripts (eval_transcripts.jsonl),
  filtered by run, kind, step range, agent, role, lowest reward and text; each turn shows every action's
  role, agent, policy version, prompt, completion and advantage, and the turn's reward (a role's attempts at
  one prompt together: the prompt once, then each attempt's completion, reward and advantage). The filter is kept
  in the address's fragment (`report.html#kind=train&reward_min=1`), so a view can be linked to (a malformed
  fragment is ignored). At most `max_mb` of episodes are inlined (`orchestrator.transcripts`: the most recent
  and a spread of the older ones, the rest counted on the page); a malformed record is skipped and counted;
- each run's config.yaml and the environment's source (RUN_DIR/source/).

Only regular files inside a run directory are read (`orchestrator/runfiles.py`): a link, or anything else, in place
of a record or a source file is listed as skipped, never followed. `--out` never replaces a file that is not a report
marsi wrote unless `--force` is given.
"""

from __future__ import annotations

import html
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from orchestrator.checkpoint_files import EVAL_TRANSCRIPTS, TRANSCRIPTS
from orchestrator.plot import CONFIDENCE, SMOOTHING, Panel, flat_notes, panels, read_runs
from orchestrator.runfiles import check_output, listing, read_records, read_text, skipped, write_output
from orchestrator.transcripts import MAX_MB, Inlined, inlined

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]


def _rgba(color: str, alpha: float) -> str:
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def _gaps(values: list[float]) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values]


def chart(panel: Panel) -> str:
    """One panel as a Plotly chart (a div and the script that draws it; plotly.js is inlined once, in the head)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for s in panel.series:
        color = PALETTE[s.color % len(PALETTE)]
        if s.band is not None:
            fig.add_trace(go.Scatter(x=s.steps, y=_gaps(s.band[0]), mode="lines", line={"width": 0},
                                     showlegend=False, hoverinfo="skip", legendgroup=s.label))
            fig.add_trace(go.Scatter(x=s.steps, y=_gaps(s.band[1]), mode="lines", line={"width": 0}, fill="tonexty",
                                     fillcolor=_rgba(color, 0.15), showlegend=False, hoverinfo="skip",
                                     legendgroup=s.label))
        if s.raw is not None:
            fig.add_trace(go.Scatter(x=s.steps, y=_gaps(s.raw), mode="lines", name=f"{s.label} (raw)",
                                     line={"color": color, "width": 1}, opacity=0.35, legendgroup=s.label,
                                     showlegend=False))
        error = {"type": "data", "array": _gaps(s.errors), "visible": True} if s.errors is not None else None
        fig.add_trace(go.Scatter(x=s.steps, y=_gaps(s.values), mode="lines+markers", name=s.label,
                                 line={"color": color, "width": 2 if s.raw is not None else 1.2},
                                 marker={"size": 4}, error_y=error, legendgroup=s.label,
                                 connectgaps=s.errors is not None))
    fig.update_layout(title={"text": panel.title, "font": {"size": 13}}, height=320,
                      margin={"l": 50, "r": 10, "t": 40, "b": 40}, template="plotly_white",
                      legend={"font": {"size": 10}}, showlegend=len(panel.series) > 1 or panel.series[0].raw is None)
    steps = [x for s in panel.series for x in s.steps]
    span = max(steps, default=1) - min(steps, default=0)
    fig.update_xaxes(title_text="step", tick0=0, dtick=max(1, math.ceil(span / 8)))  # whole steps only
    fig.update_yaxes(title_text=panel.ylabel)
    return fig.to_html(full_html=False, include_plotlyjs=False, config={"displaylogo": False, "displayModeBar": False, "responsive": True})


def evaluation_rows(run_dir: Path) -> list[dict[str, Any]]:
    """Every evaluation of a run: the run's own (`eval/` keys of metrics.jsonl; step 0 is the initial weights)
    and `marsi eval`'s (eval.jsonl, by checkpoint), each as {when, setting, metrics: {name: (mean, 95% +-)}}."""
    out = []
    for row in read_records(run_dir, "metrics.jsonl"):
        if "eval/reward/mean" in row:
            out += _settings(f"step {row['step']}" + (" (initial)" if row["step"] == 0 else ""), row, "eval/")
    for row in read_records(run_dir, "eval.jsonl"):
        out += _settings(f"marsi eval: {row.get('checkpoint', row['step'])}", row, "eval/")
    return out


def _settings(when: str, row: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """One table row per setting of an evaluation row: as trained (`eval/KEY`) and per partner label."""
    keys = [k.removeprefix(prefix) for k in row if k.startswith(prefix) and not k.endswith("/stderr")]
    labels = sorted({k.split("/", 1)[0] for k in keys if "/" in k and f"{prefix}{k.split('/', 1)[0]}/reward/mean" in row})
    out = []
    for label in ["", *labels]:
        mine = {}
        for key in keys:
            name = key.removeprefix(f"{label}/") if label else key
            if (label and not key.startswith(f"{label}/")) or (not label and key.split("/", 1)[0] in labels):
                continue
            if name == "episodes" or not isinstance(row[prefix + key], (int, float)):
                continue
            stderr = row.get(f"{prefix}{key}/stderr")
            mine[name] = (row[prefix + key], CONFIDENCE * stderr if isinstance(stderr, (int, float)) else None)
        out.append({"when": when, "setting": label or "as trained", "metrics": mine,
                    "episodes": row.get(f"{prefix}{label + '/' if label else ''}episodes")})
    return out


def evaluation_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p class=note>No evaluation in this run (add an <code>eval:</code> section to the config).</p>"
    names = sorted({k for r in rows for k in r["metrics"]}, key=lambda k: (k != "reward/mean", k))
    head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
    body = []
    for r in rows:
        cells = []
        for n in names:
            mean, ci = r["metrics"].get(n, (None, None))
            cells.append("<td>-</td>" if mean is None else
                         f"<td>{mean:.3f}" + (f" <span class=ci>&plusmn; {ci:.3f}</span>" if ci is not None else "") + "</td>")
        episodes = "" if r["episodes"] is None else f"{int(r['episodes'])}"
        body.append(f"<tr><td>{html.escape(r['when'])}</td><td>{html.escape(r['setting'])}</td><td>{episodes}</td>"
                    + "".join(cells) + "</tr>")
    return (f"<table class=eval><thead><tr><th>evaluation</th><th>setting</th><th>episodes</th>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table><p class=note>mean &plusmn; 95% confidence (1.96 standard errors, "
            "clustered per held-out sample)</p>")


def _flat(notes: list[str]) -> str:
    """The constant curves, which get no panel: one line each."""
    if not notes:
        return ""
    return ("<p class=note id=flat>Constant over the run (no panel): "
            + "; ".join(f"<span>{html.escape(n)}</span>" for n in notes) + ".</p>")


def _held(found: Inlined, max_mb: float) -> str:
    """What the page holds of the runs' episodes: how many of how many, and the malformed records skipped."""
    parts = []
    if len(found.episodes) < found.total:
        parts.append(f"This page holds {len(found.episodes)} of the runs' {found.total} saved episodes (the most recent "
                     f"and a spread over the older ones, {max_mb:g} MB in all); <code>marsi report --max-mb</code> "
                     "holds more.")
    if found.skipped:
        where = ", ".join(found.skipped[:5]) + (", ..." if len(found.skipped) > 5 else "")
        parts.append(f"{len(found.skipped)} malformed transcript record(s) skipped ({html.escape(where)}).")
    return f"<p class=note id=held>{' '.join(parts)}</p>" if parts else ""


def _json_script(element_id: str, value: Any) -> str:
    """`value` as JSON in a data block. Every `<` is written `\\u003c` (the same string to JSON.parse), so text
    the models wrote (`</script>`, `<!--<script>`) can neither end the block nor change how HTML parses it."""
    text = json.dumps(value, allow_nan=False, default=str).replace("<", "\\u003c")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


READ = ["config.yaml", "metrics.jsonl", "eval.jsonl", TRANSCRIPTS, EVAL_TRANSCRIPTS, "source"]
"""What the report reads of a run directory (and each file in source/)."""


def passed_over(run_dir: Path) -> list[str]:
    """What the report does not read of `run_dir` because it is not a regular file inside it (a link, ...)."""
    sources = [f"source/{name}" for name in listing(run_dir, "source")]
    return skipped(run_dir, [name for name in READ if name != "source"] + sources) + (
        ["source (a link)"] if (run_dir / "source").is_symlink() else [])


def _sources(run_dir: Path) -> str:
    parts = []
    config = read_text(run_dir, "config.yaml")
    if config is not None:
        parts.append(f"<details open><summary>config.yaml</summary><pre>{html.escape(config)}</pre></details>")
    for name in listing(run_dir, "source"):
        text = read_text(run_dir, f"source/{name}")
        if text is not None:
            parts.append(f"<details><summary>source/{html.escape(name)}</summary><pre>{html.escape(text)}</pre></details>")
    passed = passed_over(run_dir)
    if passed:
        parts.append("<p class=note>Skipped, not regular files inside the run directory (never followed): "
                     f"{html.escape(', '.join(passed))}</p>")
    return "".join(parts) or "<p class=note>No config.yaml in this run directory.</p>"


def report(run_dirs: str | Path | list[str | Path], out: str | Path | None = None,
           smoothing: float = SMOOTHING, max_mb: float = MAX_MB, *, force: bool = False) -> Path:
    """Write the HTML report of `run_dirs` to `out` (default: the first run's report.html), inlining at most
    `max_mb` of their episodes (`orchestrator.transcripts`); returns its path. A file at `out` that is not a report
    marsi wrote is replaced only with `force` (`runfiles.write_output`)."""
    from plotly.offline import get_plotlyjs

    run_dirs = [Path(d) for d in ([run_dirs] if isinstance(run_dirs, (str, Path)) else run_dirs)]
    runs = read_runs(run_dirs)
    out = Path(out) if out is not None else run_dirs[0] / "report.html"
    check_output(out, force=force)  # before anything is read
    charts = "".join(f"<div class=chart>{chart(p)}</div>" for p in panels(runs, smoothing))
    names = list(runs)
    evals = "".join(f"<h3>{html.escape(n)}</h3>{evaluation_table(evaluation_rows(d))}" if len(names) > 1
                    else evaluation_table(evaluation_rows(d)) for n, d in zip(names, run_dirs))
    found = inlined(dict(zip(names, run_dirs)), max_mb)
    sources = "".join(f"<h3>{html.escape(n)}</h3>{_sources(d)}" if len(names) > 1 else _sources(d)
                      for n, d in zip(names, run_dirs))
    title = "marsi report: " + ", ".join(names)
    page = PAGE.format(title=html.escape(title), plotly=get_plotlyjs(), style=STYLE, charts=charts, evals=evals,
                       flat=_flat(flat_notes(runs)), held=_held(found, max_mb),
                       data=_json_script("episodes", found.episodes), script=SCRIPT, sources=sources,
                       made=time.strftime("%Y-%m-%d %H:%M:%S"), smoothing=f"{smoothing:g}")
    for d in run_dirs:
        passed = passed_over(d)
        if passed:
            print(f"marsi: {d}: skipped {', '.join(passed)}: the report reads only regular files inside a run "
                  "directory", file=sys.stderr, flush=True)
    return write_output(out, page, force=force)


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0 1.5em 2em; color: #222; }
h1 { font-size: 1.4em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 8px; }
.note { color: #666; font-size: 0.9em; }
table.eval { border-collapse: collapse; font-size: 0.9em; } table.eval td, table.eval th { border: 1px solid #ddd;
  padding: 2px 6px; text-align: right; } table.eval td:first-child, table.eval td:nth-child(2) { text-align: left; }
.ci { color: #888; }
#filters label { margin-right: 1em; white-space: nowrap; } #filters input[type=number] { width: 5em; }
#list { list-style: none; padding: 0; } .episode { border: 1px solid #ddd; margin: 4px 0; border-radius: 4px; }
.episode > summary { cursor: pointer; padding: 4px 8px; background: #f6f6f6; }
.turn { margin: 6px 10px; } .action { border-left: 3px solid #ccc; margin: 4px 0 4px 8px; padding-left: 8px; }
pre { white-space: pre-wrap; background: #fafafa; padding: 4px 6px; margin: 2px 0; font-size: 0.85em; }
.meta { color: #555; font-size: 0.9em; }
"""

SCRIPT = r"""
(function () {
  const sound = e => e && typeof e === "object" && Array.isArray(e.turns) && e.turns.every(t =>
    t && Array.isArray(t.actions) && t.infos && typeof t.infos === "object" &&
    t.actions.every(a => a && typeof a.role === "string" && typeof a.agent === "string"));
  const data = JSON.parse(document.getElementById("episodes").textContent);
  const all = data.filter(sound), unsound = data.length - all.length;  // a record the page cannot show: skipped
  const form = document.getElementById("filters"), list = document.getElementById("list");
  const count = document.getElementById("count"), LIMIT = 200;
  const fields = ["run", "kind", "step_min", "step_max", "agent", "role", "reward_min", "text"];
  function options(id, values) {
    const select = document.getElementById(id);
    for (const v of [...new Set(values)].sort()) {
      const o = document.createElement("option"); o.value = o.textContent = v; select.appendChild(o);
    }
  }
  const actions = e => e.turns.flatMap(t => t.actions);
  options("run", all.map(e => e.run));
  options("agent", all.flatMap(e => actions(e).map(a => a.agent)));
  options("role", all.flatMap(e => actions(e).map(a => a.role)));
  function read() {
    const f = {};
    for (const name of fields) f[name] = form.elements[name].value.trim();
    return f;
  }
  function matches(e, f) {
    if (f.run && e.run !== f.run) return false;
    if (f.kind && e.kind !== f.kind) return false;
    if (f.step_min !== "" && e.step < Number(f.step_min)) return false;
    if (f.step_max !== "" && e.step > Number(f.step_max)) return false;
    if (f.reward_min !== "" && !(e.reward >= Number(f.reward_min))) return false;
    const acts = actions(e);
    if ((f.agent || f.role) && !acts.some(a => (!f.agent || a.agent === f.agent) && (!f.role || a.role === f.role)))
      return false;
    if (f.text) {
      const needle = f.text.toLowerCase();
      if (!acts.some(a => (JSON.stringify(a.prompt) + " " + a.completion).toLowerCase().includes(needle))) return false;
    }
    return true;
  }
  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function number(x) { return x === null || x === undefined ? "-" : (Math.round(x * 1000) / 1000).toString(); }
  function prompt(p) { return typeof p === "string" ? p : p.map(m => m.role + ": " + m.content).join("\n"); }
  function episode(e, open) {
    const node = el("details", {"class": "episode", "data-run": e.run, "data-kind": e.kind, "data-step": e.step,
                                "data-episode": e.episode, "data-reward": e.reward});
    if (open) node.open = true;
    const setting = e.setting ? " [" + e.setting + "]" : "";
    const info = Object.entries(e.info).map(([k, v]) => k + "=" + number(v)).join(" ");
    node.appendChild(el("summary", {}, e.run + " " + e.kind + setting + " step " + e.step + " episode " + e.episode +
      " (sample " + e.sample + "): reward " + number(e.reward) + ", " + e.turns.length + " turn(s), " + e.ended +
      (info ? "; " + info : "")));
    e.turns.forEach((t, i) => {
      const turn = el("div", {"class": "turn"});
      const reward = typeof t.reward === "object" ? JSON.stringify(t.reward) : number(t.reward);
      turn.appendChild(el("div", {"class": "meta"}, "turn " + (i + 1) + ": reward " + reward));
      const shown = new Set();  // attempts roles already drawn: their k attempts go in one box, under one prompt
      for (const a of t.actions) {
        if (shown.has(a.role)) continue;
        const tries = t.actions.filter(b => b.role === a.role && b.attempt !== undefined && b.attempt !== null);
        const box = el("div", {"class": "action"});
        const version = a.policy_version === null || a.policy_version === undefined ? "-" : a.policy_version;
        const why = b => {
          const info = t.infos[b.role] || {};
          const reason = (tries.length && info.attempts ? info.attempts[b.attempt] || {} : info).reason;
          return reason ? "; invalid: " + reason : "";
        };
        const about = b => ", advantage " + number(b.advantage) + ", finished by " + b.finish_reason + why(b);
        const head = a.role + " played by " + a.agent + " (policy version " + version + ")";
        if (!tries.length) {
          box.appendChild(el("div", {"class": "meta"}, head + about(a)));
          box.appendChild(el("pre", {"class": "prompt"}, prompt(a.prompt)));
          box.appendChild(el("pre", {"class": "completion"}, a.completion));
        } else {
          shown.add(a.role);
          const own = typeof t.reward === "object" ? t.reward[a.role] : t.reward;
          box.appendChild(el("div", {"class": "meta"}, head + ", " + tries.length + " attempts at one prompt"));
          box.appendChild(el("pre", {"class": "prompt"}, prompt(a.prompt)));
          for (const b of tries) {
            const reward = Array.isArray(own) ? own[b.attempt] : own;
            box.appendChild(el("div", {"class": "meta attempt"}, "attempt " + (b.attempt + 1) + ": reward " +
              number(reward) + about(b)));
            box.appendChild(el("pre", {"class": "completion"}, b.completion));
          }
        }
        turn.appendChild(box);
      }
      node.appendChild(turn);
    });
    return node;
  }
  function render() {
    const f = read();
    const found = all.filter(e => matches(e, f));
    let failed = 0;
    list.replaceChildren(...found.slice(0, LIMIT).flatMap((e, i) => {
      try {
        const li = el("li"); li.appendChild(episode(e, i === 0)); return [li];
      } catch (error) { failed += 1; return []; }  // one record that cannot be drawn stops no other
    }));
    count.textContent = found.length + " of " + all.length + " episodes match" +
      (found.length > LIMIT ? "; the first " + LIMIT + " are listed" : "") +
      (unsound + failed ? "; " + (unsound + failed) + " malformed record(s) not shown" : "");
    const hash = fields.filter(n => f[n] !== "").map(n => n + "=" + encodeURIComponent(f[n])).join("&");
    history.replaceState(null, "", hash ? "#" + hash : location.pathname);
  }
  for (const part of location.hash.slice(1).split("&")) {
    const at = part.indexOf("="), name = at < 0 ? part : part.slice(0, at);
    let value = at < 0 ? "" : part.slice(at + 1);
    try { value = decodeURIComponent(value); } catch (error) { continue; }  // a malformed escape: ignored
    if (fields.includes(name)) form.elements[name].value = value;
  }
  form.addEventListener("input", render);
  form.addEventListener("reset", () => setTimeout(render));
  render();
  document.body.dataset.ready = "1";
})();
"""

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{style}</style>
<script>{plotly}</script>
</head><body>
<h1>{title}</h1>
<p class=note>Written {made} by <code>marsi report</code>. Reward curves: raw (thin) under an exponential moving
average (weight {smoothing}).</p>
<h2 id=curves>Curves</h2>
<div class=charts>{charts}</div>
{flat}
<h2 id=evaluation>Evaluation</h2>
{evals}
<h2 id=episodes-section>Episodes</h2>
{held}
<form id=filters onsubmit="return false">
<label>run <select name=run id=run><option value="">all</option></select></label>
<label>kind <select name=kind><option value="">all</option><option value=train>training</option>
<option value=eval>evaluation</option></select></label>
<label>steps <input type=number name=step_min placeholder=from> to <input type=number name=step_max placeholder=to></label>
<label>agent <select name=agent id=agent><option value="">any</option></select></label>
<label>role <select name=role id=role><option value="">any</option></select></label>
<label>reward &ge; <input type=number name=reward_min step=any></label>
<label>text <input type=search name=text placeholder="in a prompt or completion"></label>
<button type=reset>clear</button>
</form>
<p id=count class=note></p>
<ul id=list></ul>
<h2 id=config>Config and environment source</h2>
{sources}
{data}
<script>{script}</script>
</body></html>
"""
