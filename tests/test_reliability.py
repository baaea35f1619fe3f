"""Surviving dead and hung trainers, exact resume, damaged checkpoints, graceful stop."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import pytest

from agent_trainer import storage
from orchestrator.checkpoints import RunFailed
from orchestrator.coordinator import Coordinator
from orchestrator.runlog import RunLog, checkpoint_problem
from protocols.config import validate_config
from tests.envs import config
from tests.runs import MARSI, sigkill_a_run_after, rows, without_times, write, run_killing, uninterrupted_rows

STEPS = 4


def raw_config(**train):
    return config(train={"steps": STEPS, "checkpoint_every": 1, "keep_checkpoints": 5, **train})


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The reference run's directory: same seed, no interruption (in-process trainers), a checkpoint every step."""
    run_dir = tmp_path_factory.mktemp("whole")
    uninterrupted_rows(validate_config(raw_config()), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(whole):
    """Metrics of the reference run."""
    return without_times(rows(whole))


def test_killed_trainer_is_restarted_and_the_run_ends_as_if_uninterrupted(ray_cluster, tmp_path, uninterrupted):
    raw = raw_config()
    raw["ray"]["enabled"] = True
    with Coordinator(validate_config(raw), tmp_path) as coord:
        victim = coord.pool.info()["b"]["pid"]

        run_killing(coord, victim, at_step=2)
        assert coord.restarts == 1
        assert coord.pool.info()["b"]["pid"] != victim
    metrics = rows(tmp_path)
    assert without_times(metrics) == uninterrupted
    assert any("time/recovery" in m for m in metrics)


def test_hung_trainer_is_reported_and_restarts_are_limited(ray_cluster, tmp_path):
    raw = config(("a",), ray=True, train={"steps": STEPS, "checkpoint_every": 1, "call_timeout_s": 0.001,
                                           "max_restarts": 1})  # one trainer: each restart starts one process
    with pytest.raises(RunFailed, match=r"agent 'a': generate failed: no answer within 0.001s \(hung\); "
                                        r"stopping after 1 restarts; last good checkpoint: .*step-000000"):
        with Coordinator(validate_config(raw), tmp_path) as coord:
            coord.run()
    assert checkpoint_problem(RunLog(tmp_path).latest_checkpoint()) is None


def test_sigkilled_coordinator_resumes_to_the_same_metrics(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    sigkill_a_run_after(write(tmp_path, raw_config()), run_dir)
    assert len(rows(run_dir)) < STEPS
    out = subprocess.run([*MARSI, "resume", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert without_times(rows(run_dir)) == uninterrupted


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, whole, uninterrupted):
    run_dir = tmp_path / "run"
    shutil.copytree(whole, run_dir, ignore=shutil.ignore_patterns(".lock"))  # a finished run, every checkpoint kept
    log = RunLog(run_dir)
    newest = log.latest_checkpoint()
    weights = storage.on_disk(newest) / "agents" / "a" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut off mid-file
    assert "model.safetensors" in checkpoint_problem(newest)
    out = subprocess.run([*MARSI, "resume", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"checkpoint {newest.name} is damaged" in out.stderr and "falling back to step-000003" in out.stderr
    assert without_times(rows(run_dir)) == uninterrupted


def test_unfinished_checkpoints_are_never_listed(tmp_path):
    log = RunLog(tmp_path)
    storage.write_bytes(log.staging_path(7) / "agents" / "a" / "trainer_state.pt", b"partial")  # a write cut off
    storage.make_dirs(log.checkpoint_dir() / "step-000009")  # no coordinator.json: incomplete
    assert log.checkpoints() == [] and log.latest_checkpoint() is None


def test_a_run_directory_left_by_a_cut_off_write_of_earlier_marsi_resumes(tmp_path, uninterrupted):
    """Earlier marsi wrote a run directory's checkpoint under `.tmp-step-N/` and renamed it into place; a
    run it left with such a write cut off resumes from its last checkpoint (same layout, same record), and
    the leftover goes at the next commit."""
    run_dir = tmp_path / "run"
    with Coordinator(validate_config(raw_config(steps=2)), run_dir) as coord:
        coord.run()
    leftover = run_dir / "checkpoints" / ".tmp-step-000003"
    (leftover / "agents" / "a").mkdir(parents=True)
    (leftover / "agents" / "a" / "trainer_state.pt").write_bytes(b"partial")
    with Coordinator.resume(run_dir, ["train.steps=4"]) as coord:
        assert coord.restored_from.name == "step-000002"
        coord.run()
    assert not leftover.exists()
    assert [c.name for c in RunLog(run_dir).checkpoints()] == [f"step-00000{i}" for i in range(5)]
    assert without_times(rows(run_dir)) == uninterrupted


def test_a_stop_asked_after_the_steps_checkpoint_was_decided_still_checkpoints_that_step(tmp_path, monkeypatch):
    """A stop request (SIGTERM) that lands after a step decided it needs no checkpoint, before the loop looks at the
    request again: the run still ends with a checkpoint of the step it stopped at."""
    from orchestrator import step_loop

    shown = step_loop.show_step
    with Coordinator(validate_config(raw_config(checkpoint_every=0)), tmp_path) as coord:
        def show_then_stop(bar, metrics):
            shown(bar, metrics)
            coord.request_stop()

        monkeypatch.setattr(step_loop, "show_step", show_then_stop)
        coord.run()
        assert coord.state.step == 1
    assert RunLog(tmp_path).latest_checkpoint().name == "step-000001"


def test_sigterm_stops_at_a_safe_point_with_a_checkpoint(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    raw = raw_config(checkpoint_every=0)
    proc = subprocess.Popen([*MARSI, "run", str(write(tmp_path, raw)), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (run_dir / "metrics.jsonl").exists():
        assert proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = len(rows(run_dir))
    assert stopped < STEPS and f"stopped at step {stopped}" in err
    assert RunLog(run_dir).latest_checkpoint().name == f"step-{stopped:06d}"
    with Coordinator.resume(run_dir) as coord:  # `marsi resume` of a stopped run: test_sigkilled_coordinator_...
        coord.run()
    assert without_times(rows(run_dir)) == uninterrupted
