"""What a run prints: start-up phases with their times on stdout, progress as plain lines when not on a
terminal, and a closed pipe ending a command quietly."""

from __future__ import annotations

import io
import signal
import subprocess

from orchestrator.console import PlainProgress, progress
from tests.envs import HERE, config
from tests.runs import MARSI, marsi, write


def test_plain_progress_writes_a_line_every_few_steps_and_at_the_last():
    out = io.StringIO()
    bar = PlainProgress(total=7, initial=0, every=3, stream=out)
    for step in range(1, 8):
        bar.set_postfix(reward=f"{step / 10:.3f}", training="a")
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "marsi: step 3/7, reward 0.300, training a", "marsi: step 6/7, reward 0.600, training a",
        "marsi: step 7/7, reward 0.700, training a"]
    assert all(line.endswith(" s/step)") for line in lines) and "\r" not in out.getvalue()


def test_the_bar_is_tqdm_on_a_terminal_and_plain_lines_elsewhere():
    assert isinstance(progress(0, 10, True, terminal=False), PlainProgress)
    bar = progress(0, 10, True, terminal=True)
    assert type(bar).__name__ == "tqdm" and not bar.disable
    bar.close()
    assert progress(0, 10, False, terminal=False).disable  # train.progress false: nothing at all


def test_a_piped_run_says_each_start_up_phase_and_writes_no_bar_fragments(tmp_path):
    raw = config(train={"steps": 4, "progress": True})
    raw["eval"] = {"data": {"factory": f"{HERE / 'envs.py'}:held_out"}}
    out = marsi("run", write(tmp_path, raw), "--run-dir", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stdout.splitlines() if line.startswith("marsi: ")]
    assert any(line.startswith("marsi: 2 trainer(s) up; model load a ") and line.endswith(" s)") for line in said), said
    assert any(line.startswith("marsi: evaluation at step 0: eval/reward/mean ") for line in said), said
    assert "\r" not in out.stderr and "it/s" not in out.stderr and "step/s" not in out.stderr
    steps = [line for line in out.stderr.splitlines() if line.startswith("marsi: step ")]
    assert [line.split(",")[0] for line in steps] == [f"marsi: step {n}/4" for n in range(1, 5)]


def test_a_closed_pipe_ends_quietly():
    child = subprocess.Popen([*MARSI, "schema"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()  # the reader is gone before marsi writes (marsi schema | head, head already done)
    _, err = child.communicate(timeout=120)
    assert err == "" and child.returncode == 128 + signal.SIGPIPE
