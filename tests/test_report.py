"""`marsi report` end to end: a short tiny run through the CLI, its HTML file read as data and opened in
headless Chromium (Debian's `chromium`, installed by `make setup`), where the episode filter must find a known
episode and the page must log nothing to the console."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.envs import HERE, config
from tests.errors_doc import assert_documented
from tests.inproc import marsi
from tests.runs import marsi as subprocess_marsi
from tests.runs import write

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH; make setup installs Debian's")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step run of two agents with evaluation, every training episode kept, and its report (`marsi report` in a
    subprocess, as a user runs it; the run and the other reports of this file in the test's process)."""
    tmp = tmp_path_factory.mktemp("report")
    raw = config(train={"steps": 3, "batch_size": 2, "num_generations": 4, "transcripts_per_step": 8, "progress": False})
    raw["eval"] = {"data": {"factory": f"{HERE / 'envs.py'}:held_out"}, "episodes_per_sample": 2, "temperature": 1.0,
                   "transcripts": 4}
    for agent in raw["agents"].values():
        agent["generation"]["temperature"] = 1.0
    out = marsi("run", write(tmp, raw), "--run-dir", tmp / "run")
    assert out.returncode == 0, out.stderr
    out = subprocess_marsi("report", tmp / "run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp / "run" / "report.html")
    return tmp / "run"


def payload(page: str) -> list[dict]:
    found = re.search(r'<script type="application/json" id="episodes">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def test_the_report_is_one_file_holding_curves_evaluations_episodes_and_config(run):
    page = (run / "report.html").read_text()
    # self-contained: no script, style or image is fetched from anywhere
    assert not re.search(r'<(script|img|iframe)[^>]+src=|<link[^>]+href=', page)
    assert page.count("Plotly.newPlot") >= 3 and "shared reward" in page and "entropy per agent" in page
    assert "step 0 (initial)" in page and "step 3" in page  # the evaluation table: initial weights and the end
    assert "environment:" in page and "source/envs.py" in page and "class LetterEnv" in page
    episodes = payload(page)
    train = [e for e in episodes if e["kind"] == "train"]
    evals = [e for e in episodes if e["kind"] == "eval"]
    assert len(train) == 3 * 8 and len(evals) == 2 * 4  # every kept episode, at both evaluations
    acted = [a for e in train for t in e["turns"] for a in t["actions"]]
    assert {a["agent"] for a in acted} == {"a", "b"} and all(isinstance(a["advantage"], float) for a in acted)
    assert {(e["step"], a["policy_version"]) for e in train for t in e["turns"] for a in t["actions"]} == {
        (1, 0), (2, 1), (3, 2)}
    assert {e["step"] for e in evals} == {0, 3}


def chromium(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", *args], capture_output=True, text=True, timeout=timeout)


def console(out: subprocess.CompletedProcess) -> list[str]:
    """What the page wrote to its console (messages and uncaught errors), as Chromium logs them."""
    return [line for line in out.stderr.splitlines() if ":CONSOLE" in line]


@needs_chromium
def test_headless_chromium_sees_console_errors(tmp_path):
    page = tmp_path / "broken.html"
    page.write_text("<html><body><script>undefinedFunction();</script></body></html>")
    assert console(chromium("--dump-dom", page.as_uri()))  # what the next test counts on to see errors


@needs_chromium
def test_model_text_that_looks_like_html_stays_text(run, tmp_path):
    """Completions are the model's, untrusted: an HTML comment opening a script, and a closing script tag followed by
    a script, must neither run nor cut the page's data short."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    first = json.loads((copy / "transcripts.jsonl").read_text().splitlines()[0])
    hostile = "<!--<script>x</script> </script><script>document.title='pwned'</script><!--"
    first["turns"][0]["actions"][0]["completion"] = hostile
    with open(copy / "transcripts.jsonl", "a") as f:
        f.write(json.dumps({**first, "step": 99}) + "\n")
    assert marsi("report", copy).returncode == 0
    page = (copy / "report.html").read_text()
    assert any(hostile in json.dumps(episode) for episode in payload(page))  # kept, as text
    out = chromium("--dump-dom", (copy / "report.html").as_uri() + "#kind=train&step_min=99")
    assert out.returncode == 0 and console(out) == [], console(out)
    assert 'data-ready="1"' in out.stdout and "pwned" not in re.search(r"<title>(.*?)</title>", out.stdout).group(1)


@needs_chromium
def test_the_episode_filter_finds_the_first_episode_in_which_both_agents_were_right(run, tmp_path):
    lines = [json.loads(line) for line in (run / "transcripts.jsonl").read_text().splitlines()]
    best = max(e["reward"] for e in lines)  # 1.0: both agents said the letter; else the best the run has
    first = next(e for e in lines if e["reward"] >= best)
    url = (run / "report.html").as_uri() + f"#kind=train&reward_min={best}"
    out = chromium("--dump-dom", url)
    assert out.returncode == 0 and console(out) == [], console(out)
    dom = out.stdout
    assert 'data-ready="1"' in dom  # the browser's script ran to its end
    shown = re.findall(r'<details class="episode" data-run="run" data-kind="(\w+)" data-step="(\d+)" '
                       r'data-episode="(\d+)"', dom)
    assert shown[0] == ("train", str(first["step"]), str(first["episode"]))
    assert len(shown) == sum(e["reward"] >= best for e in lines)
    assert re.search(rf'{len(shown)} of {len(lines) + 8} episodes match', dom)
    # the first match is opened: its prompts and completions are on the page
    assert "Say " in dom and "policy version" in dom and "advantage" in dom
    # a filter on one agent's role and a step range narrows it down the same way as the data says
    out = chromium("--dump-dom", (run / "report.html").as_uri() + "#kind=eval&step_min=3&role=r1&agent=b")
    assert console(out) == [] and len(re.findall(r'data-kind="eval" data-step="3"', out.stdout)) == 4
    assert 'data-step="0"' not in out.stdout


@needs_chromium
def test_a_malformed_record_is_skipped_and_counted_and_a_malformed_fragment_ignored(run, tmp_path):
    """A record whose first turn's actions are null, one whose reward is text, and a line that is not JSON: each is
    skipped and counted on the page, and the browser lists the others. An address whose fragment holds a malformed
    escape (`%E0%A4%A`) opens the page as if it had none. (Both stopped the whole episode browser.)"""
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    first = json.loads((copy / "transcripts.jsonl").read_text().splitlines()[0])
    broken = json.loads(json.dumps(first))
    broken["turns"][0]["actions"] = None
    with open(copy / "transcripts.jsonl", "a") as f:
        f.write(json.dumps({**broken, "step": 98}) + "\n" + json.dumps({**first, "step": 99, "reward": "x"}) + "\n"
                + "{not json\n" + json.dumps({**first, "step": 100}) + "\n")
    assert marsi("report", copy).returncode == 0
    page = (copy / "report.html").read_text()
    assert {e["step"] for e in payload(page)} >= {100} and not {98, 99} & {e["step"] for e in payload(page)}
    assert f"3 malformed transcript record(s) skipped ({copy}/transcripts.jsonl:25, " in page
    for fragment in ("#kind=train&step_min=100", "#text=%E0%A4%A&kind=train&step_min=100", "#%&=&step_min=100"):
        out = chromium("--dump-dom", (copy / "report.html").as_uri() + fragment)
        assert out.returncode == 0 and console(out) == [], (fragment, console(out))
        assert 'data-ready="1"' in out.stdout, fragment
        assert len(re.findall(r'<details class="episode" data-run="run" data-kind="train" data-step="100"',
                              out.stdout)) == 1, fragment


def test_the_report_inlines_episodes_up_to_its_bound_the_most_recent_and_a_spread(tmp_path):
    """3 MB of transcripts over 100 steps, a report bounded to 1 MB: it holds at most that much of them, the newest
    steps whole and a spread of the older ones, and says how many of how many."""
    from orchestrator.report import report

    rows = [{"step": s, "reward/mean": 0.0, "trained": []} for s in range(1, 101)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    action = {"role": "r0", "agent": "a", "prompt": "p" * 700, "completion": "c" * 700, "advantage": 0.0,
              "policy_version": 0, "finish_reason": "stop"}
    record = lambda step, i: {"step": step, "episode": 20 * step + i, "sample": i, "reward": 1.0, "info": {},  # noqa: E731
                              "terminated": True, "turns": [{"reward": 1.0, "infos": {}, "actions": [action]}]}
    lines = [json.dumps(record(step, i)) + "\n" for step in range(1, 101) for i in range(20)]
    (tmp_path / "transcripts.jsonl").write_text("".join(lines))
    assert sum(map(len, lines)) > 2.9e6
    page = report(tmp_path, tmp_path / "report.html", max_mb=1.0).read_text()
    kept = payload(page)
    assert sum(len(json.dumps(e)) for e in kept) <= 1.05e6 and 500 < len(kept) < 2000 // 2
    steps = {e["step"] for e in kept}
    assert {97, 98, 99, 100} <= steps and 1 in steps and len(steps & set(range(1, 60))) > 20  # recent, and spread
    assert f"This page holds {len(kept)} of the runs' 2000 saved episodes" in page
    out = marsi("report", tmp_path, "--out", tmp_path / "all.html", "--max-mb", "10")
    assert out.returncode == 0, out.stderr
    assert len(payload((tmp_path / "all.html").read_text())) == 2000 and "This page holds" not in \
        (tmp_path / "all.html").read_text()
    out = marsi("report", tmp_path, "--max-mb", "0")
    assert_documented("report_max_mb_not_positive", out.stderr, exit=out.returncode)


@needs_chromium
def test_a_screenshot_of_the_report(run, tmp_path):
    """The screenshot of docs/report.md; MARSI_DOCS_SCREENSHOT=1 writes it to docs/report.png."""
    shot = tmp_path / "report.png"
    out = chromium("--window-size=1200,1000", "--hide-scrollbars", f"--screenshot={shot}",
                   (run / "report.html").as_uri() + "#kind=train")
    assert out.returncode == 0 and console(out) == [], console(out)
    assert shot.read_bytes()[:4] == b"\x89PNG" and shot.stat().st_size > 20_000  # a drawn page, not a blank one
    if os.environ.get("MARSI_DOCS_SCREENSHOT") == "1":
        shutil.copy(shot, ROOT / "docs" / "report.png")


def test_a_report_reads_only_regular_files_inside_the_run_directory(run, tmp_path):
    """A run directory received from someone else, with links to this machine's secrets in place of a source file, a
    record and the whole source folder: none is followed, each is listed as skipped, the report is written."""
    secret = tmp_path / "credentials"
    secret.write_text("[default]\naws_secret_access_key = wJalrXUtnFEMI-not-for-the-report\n")
    rows = tmp_path / "elsewhere.jsonl"  # JSON lines a link may point at, which the report would otherwise show
    rows.write_text(json.dumps({"step": 1, "checkpoint": "wJalrXUtnFEMI-not-for-the-report", "eval/reward/mean": 1.0})
                    + "\n")
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    (mine / "report.html").unlink()
    (mine / "source" / "credentials").symlink_to(secret)
    (mine / "eval.jsonl").symlink_to(rows)
    out = marsi("report", mine)
    assert out.returncode == 0, out.stderr
    page = (mine / "report.html").read_text()
    assert "wJalrXUtnFEMI" not in page
    assert "source/envs.py" in page and "class LetterEnv" in page  # the regular files are read as before
    assert "eval.jsonl (a link), source/credentials (a link)" in page
    line = next(line for line in out.stderr.splitlines() if "skipped" in line).removeprefix("marsi: ")
    assert line == (f"{mine}: skipped eval.jsonl (a link), source/credentials (a link): the report reads only regular "
                    "files inside a run directory")
    shutil.rmtree(mine / "source")
    (tmp_path / "home").mkdir()
    shutil.copy(secret, tmp_path / "home" / "envs.py")
    (mine / "source").symlink_to(tmp_path / "home")  # the folder itself a link
    (mine / "report.html").unlink()
    out = marsi("report", mine)
    assert out.returncode == 0, out.stderr
    page = (mine / "report.html").read_text()
    assert "wJalrXUtnFEMI" not in page and "source (a link)" in page


def test_out_replaces_only_a_report_unless_forced(run, tmp_path):
    """`--out` onto the run's own config.yaml, onto a directory, below a file, or onto a link: one line naming --out
    and the fix, exit 2, nothing written; a report marsi wrote is replaced; --force replaces any file (a link
    itself, never what it points at)."""
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    config_bytes = (mine / "config.yaml").read_bytes()
    out = marsi("report", mine, "--out", mine / "config.yaml")
    assert_documented("report_out_not_a_report", out.stderr.strip().splitlines()[-1], exit=out.returncode, RUN=mine)
    assert (mine / "config.yaml").read_bytes() == config_bytes
    out = marsi("report", mine, "--out", mine)
    assert_documented("report_out_directory", out.stderr.strip().splitlines()[-1], exit=out.returncode, RUN=mine)
    (tmp_path / "a-file").write_text("not a folder")
    out = marsi("report", mine, "--out", tmp_path / "a-file" / "report.html")
    assert_documented("report_out_unwritable", out.stderr.strip().splitlines()[-1], exit=out.returncode,
                      **{"<tmp>": tmp_path})
    metrics = (mine / "metrics.jsonl").read_bytes()
    (tmp_path / "link.html").symlink_to(mine / "metrics.jsonl")
    assert marsi("report", mine, "--out", tmp_path / "link.html").returncode == 2
    out = marsi("report", mine, "--out", tmp_path / "link.html", "--force")
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "link.html").is_symlink() and (mine / "metrics.jsonl").read_bytes() == metrics
    out = marsi("report", mine, "--out", tmp_path / "new" / "folder" / "report.html")  # a missing folder is made
    assert out.returncode == 0 and (tmp_path / "new" / "folder" / "report.html").is_file(), out.stderr
    assert marsi("report", mine, "--out", tmp_path / "new" / "folder" / "report.html").returncode == 0  # a report
    assert sorted(p.name for p in (tmp_path / "new" / "folder").iterdir()) == ["report.html"]
