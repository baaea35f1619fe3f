"""Attacks on run directories, resume, signals and trainer hangs: each reproduces a way to lose or mix runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent_trainer import storage
from agent_trainer.handle import TrainerFailure
from orchestrator.coordinator import Coordinator
from orchestrator.runlog import RunDirError, RunLog, checkpoint_problem, make_run_dir
from protocols.config import validate_config
from tests.envs import config
from tests.errors_doc import assert_documented, assert_quoted
from tests.runs import MARSI, marsi, rows, without_times, write

def last_line(out) -> str:
    """The last line a marsi subprocess wrote to stderr: its error."""
    return out.stderr.strip().splitlines()[-1]


def snapshot(run_dir):
    """Every file of a run directory with its bytes (the lock file aside)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(Path(run_dir).rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-step run (checkpoint every step) and its config file."""
    tmp = tmp_path_factory.mktemp("finished")
    cfg = write(tmp, config(train={"steps": 3, "checkpoint_every": 1, "keep_checkpoints": 5}))
    out = marsi("run", cfg, "--run-dir", tmp / "run")
    assert out.returncode == 0, out.stderr
    return tmp / "run", cfg


def copy_run(finished, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0], run_dir)
    return run_dir


# ------------------------------------------------------------------------------- 4: one run per directory
def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path):
    made = []
    threads = [threading.Thread(target=lambda: made.append(make_run_dir(str(tmp_path / "{name}-{time}"), "demo")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == len(set(made)) == 8 and all(p.is_dir() for p in made)


def test_a_run_dir_from_the_template_is_reused_after_a_failed_start_and_a_suffix_is_announced(tmp_path, capsys):
    from orchestrator.cli import main

    raw = config(train={"steps": 1, "run_dir": str(tmp_path / "runs" / "{name}")})
    cfg = write(tmp_path, {**raw, "eval": {"data": raw["data"]}})  # evaluation data that is training data: refused
    assert main(["run", str(cfg)]) == 2
    assert list((tmp_path / "runs").iterdir()) == []
    cfg = write(tmp_path, raw)
    assert main(["run", str(cfg)]) == 0 and main(["run", str(cfg)]) == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["run", "run-2"]
    assert f"marsi: {tmp_path / 'runs' / 'run'} exists; this run writes to {tmp_path / 'runs' / 'run-2'}" in \
        capsys.readouterr().err


def test_a_new_run_refuses_a_directory_that_holds_a_run(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    before = snapshot(run_dir)
    out = marsi("run", finished[1], "--run-dir", run_dir)
    assert_documented("run_dir_holds_run", last_line(out), exit=out.returncode, RUN=run_dir)
    assert snapshot(run_dir) == before


def test_a_live_process_keeps_others_out_of_its_run_directory(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    holder = RunLog(run_dir)
    holder.claim(resume=True)
    try:
        with pytest.raises(RunDirError, match=rf"{run_dir}: in use by marsi pid {os.getpid()}") as info:
            RunLog(run_dir).claim(resume=True)
        assert_documented("run_dir_in_use", info.value, RUN=run_dir)
        out = marsi("resume", run_dir, "train.steps=4")
        assert out.returncode == 2 and f"in use by marsi pid {os.getpid()}" in out.stderr
    finally:
        holder.release()
    RunLog(run_dir).claim(resume=True)  # free again once the holder is gone


def test_resuming_a_directory_without_a_run_is_refused(tmp_path):
    with pytest.raises(RunDirError) as info:
        RunLog(tmp_path).claim(resume=True)
    assert_documented("resume_holds_no_run", info.value, RUN=tmp_path)


def test_a_run_that_fails_to_start_leaves_no_directory(tmp_path):
    raw = config()
    raw["agents"]["a"]["model"] = str(tmp_path / "no-model")
    assert marsi("run", write(tmp_path, raw), "--run-dir", tmp_path / "run").returncode == 2
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------- 5, 6: records are never lost
def test_cutting_records_back_never_leaves_a_partial_file(tmp_path):
    log = RunLog(tmp_path)
    lines = [json.dumps({"step": 1 + i // 1000, "text": "x" * 200}) + "\n" for i in range(200_000)]
    (tmp_path / "transcripts.jsonl").write_text("".join(lines))
    kept = "".join(line for line in lines if json.loads(line)["step"] <= 100)
    code = (f"from orchestrator.runlog import RunLog; RunLog({str(tmp_path)!r}).truncate_after(100)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.8)  # killed mid-rewrite (or just after): the file is whole, old or new
    proc.kill()
    proc.wait()
    text = (tmp_path / "transcripts.jsonl").read_text()
    assert text in ("".join(lines), kept)
    log.truncate_after(100)
    assert (tmp_path / "transcripts.jsonl").read_text() == kept


def test_a_torn_last_line_is_dropped_and_resume_goes_on(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')  # a crash mid-append
    out = marsi("resume", run_dir, "train.steps=4")
    assert out.returncode == 0, out.stderr
    assert_quoted(next(line for line in out.stderr.splitlines() if "dropping a torn last line" in line), RUN=run_dir)
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3, 4]


def test_a_corrupt_line_inside_a_record_names_file_and_line(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = "garbage\n"
    (run_dir / "metrics.jsonl").write_text("".join(lines))
    out = marsi("resume", run_dir, "train.steps=4")
    assert out.stderr.count("\n") == 1
    assert_documented("record_line_corrupt", out.stderr, exit=out.returncode, RUN=run_dir)


# ------------------------------------------------------------------------ 7: a failed resume changes nothing
@pytest.mark.parametrize("overrides, case", [
    (["agents.a.model=/no/such/model"], "resume_model_missing"),
    (["agents.carol.model=builtin:tiny", "roles.assignment.r2=carol"], "resume_other_agents"),
    (["train.steps=2"], "resume_fewer_steps"),
], ids=["model_missing", "new_agent", "fewer_steps"])
def test_a_refused_resume_leaves_the_run_as_it_was(finished, tmp_path, overrides, case):
    run_dir = copy_run(finished, tmp_path)
    before = snapshot(run_dir)
    out = marsi("resume", run_dir, *overrides)
    assert_documented(case, last_line(out), exit=out.returncode, RUN=run_dir)
    assert snapshot(run_dir) == before
    out = marsi("resume", run_dir, "train.steps=4")  # the run still resumes as it was
    assert out.returncode == 0, out.stderr


def test_resume_refuses_a_model_of_another_architecture(finished, tmp_path):
    from tests.test_rl_correctness import tiny_variant

    run_dir = copy_run(finished, tmp_path)
    other = tiny_variant(tmp_path, "wider", hidden_size=64, intermediate_size=128, num_attention_heads=2,
                         num_key_value_heads=2)
    out = marsi("resume", run_dir, f"agents.b.model={other}")
    assert_documented("resume_other_architecture", last_line(out), exit=out.returncode, DIR=other)


def test_a_finished_run_says_so_and_starts_nothing(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    out = marsi("resume", run_dir)
    assert out.returncode == 0, out.stderr
    assert_quoted(next(line for line in out.stderr.splitlines() if "has done all its" in line), RUN=run_dir)
    assert "Ray" not in out.stderr


# --------------------------------------------------------------------------- 8: checkpoint integrity
def test_an_altered_coordinator_state_is_damage(finished, tmp_path):
    run_dir = copy_run(finished, tmp_path)
    newest = RunLog(run_dir).latest_checkpoint()
    record = storage.on_disk(newest) / "coordinator.json"
    state = json.loads(record.read_text())
    state["episodes"] += 1
    record.write_text(json.dumps(state))
    assert checkpoint_problem(newest) == "coordinator.json does not match its checksum"
    del state["step"]
    record.write_text(json.dumps(state))
    assert "does not match its checksum" in checkpoint_problem(newest)
    out = marsi("resume", run_dir, "train.steps=4")
    assert out.returncode == 0, out.stderr
    assert "checkpoint step-000003 is damaged (coordinator.json does not match its checksum); falling back to " \
           "step-000002" in out.stderr


def test_checkpoints_are_ordered_by_step_number(tmp_path):
    log = RunLog(tmp_path)
    for step in (999_999, 1_000_000, 20):
        staging = log.staging_path(step)
        log.commit_checkpoint(staging, step, {"step": step, "episodes": 0, "data": {}, "baselines": {}}, keep=2, files={})
    assert [p.name for p in log.checkpoints()] == ["step-999999", "step-1000000"]


# ------------------------------------------------------------------------------- 9: SIGTERM with Ray
def test_sigterm_with_ray_stops_after_the_step_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    raw = config(ray=True, train={"steps": 40})
    proc = subprocess.Popen([*MARSI, "run", str(write(tmp_path, raw)), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (run_dir / "metrics.jsonl").exists():
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = len(rows(run_dir))
    assert 0 < stopped < 40 and f"stopped at step {stopped}" in err
    assert RunLog(run_dir).latest_checkpoint().name == f"step-{stopped:06d}"


def test_sigterm_while_the_trainers_start_is_marsis_to_handle(tmp_path):
    import psutil

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*MARSI, "run", str(write(tmp_path, config(ray=True))), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    me = psutil.Process(proc.pid)

    def trainers_starting():
        with contextlib.suppress(psutil.Error):
            return any("_TrainerActor" in " ".join(p.cmdline()) for p in me.children(recursive=True))
        return False

    while not trainers_starting():  # Ray is up and its actors are starting the trainers
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received" not in err and "PC: @" not in err, err  # Ray's own handler's stack dump
    assert [line for line in err.splitlines() if line.startswith("marsi:")] == [
        "marsi: SIGTERM: stopped while starting; nothing was trained and no run directory is left"], err
    assert_quoted(next(line for line in err.splitlines() if line.startswith("marsi:")))
    assert not run_dir.exists()


# ------------------------------------------------------------------ 10, 11: deadlines and recovery faults
@pytest.fixture
def ray_coordinator(ray_cluster, tmp_path):
    raw = config(ray=True, train={"steps": 2, "checkpoint_every": 1, "checkpoint_timeout_s": 3, "max_restarts": 2})
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        coord.run(until=1)
        yield coord


def test_a_trainer_stopped_during_save_is_a_hung_trainer(ray_coordinator):
    coord = ray_coordinator
    pid = coord.pool.info()["b"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(TrainerFailure, match=r"agent 'b': save failed: no answer within 3s \(hung\)") as caught:
            coord.checkpoint(step=5)
        assert_documented("trainer_hung", str(caught.value))
        assert caught.value.recoverable
        assert [p.name for p in coord.log.checkpoints()] == ["step-000000", "step-000001"]
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_fault_while_restoring_spends_a_restart_and_is_not_damage(ray_coordinator, capfd, monkeypatch):
    coord = ray_coordinator
    pid = coord.pool.info()["a"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(TrainerFailure, match=r"agent 'a': load failed: no answer within 3s \(hung\)") as caught:
            coord.restore()
    finally:
        os.kill(pid, signal.SIGCONT)
    # the restart's own load gets a deadline a loaded machine meets (3 s was for the hang above)
    monkeypatch.setattr(coord.config.train, "checkpoint_timeout_s", 120.0)
    coord.recover(caught.value)  # restarts the trainers and restores the same, intact checkpoint
    assert coord.restarts == 1 and coord.state.step == 1
    assert "damaged" not in capfd.readouterr().err
    assert checkpoint_problem(coord.log.latest_checkpoint()) is None


def test_trainers_not_up_in_time_are_one_line(ray_cluster, tmp_path):
    from agent_trainer.handle import TrainerStartError

    with pytest.raises(TrainerStartError) as info:
        Coordinator(validate_config(config(ray=True, train={"start_timeout_s": 0.001})), tmp_path / "run").start()
    assert_documented("trainers_not_up", info.value)
    assert not (tmp_path / "run").exists()


def test_a_trainer_killed_before_the_first_checkpoint_is_restarted(ray_cluster, tmp_path):
    reference = tmp_path / "reference"
    with Coordinator(validate_config(config(train={"steps": 2})), reference) as coord:
        coord.run()
    raw = config(ray=True, train={"steps": 2})
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        os.kill(coord.pool.info()["b"]["pid"], signal.SIGKILL)  # dies before the step-0 save
        coord.run()
        assert coord.restarts == 1
    assert without_times(rows(tmp_path / "run")) == without_times(rows(reference))


def test_a_trainer_killed_during_the_resume_probe_is_restarted(ray_cluster, tmp_path, monkeypatch):
    raw = config(ray=True, train={"steps": 3, "checkpoint_every": 1})
    with Coordinator(validate_config(config(train={"steps": 3, "checkpoint_every": 1})), tmp_path / "whole") as coord:
        coord.run()
    with Coordinator(validate_config({**raw, "train": {**raw["train"], "steps": 1}}), tmp_path / "run") as coord:
        coord.run()
    probe = Coordinator._check_storage_reach
    killed = []

    def kill_then_probe(coord):  # the trainer dies as the coordinator sends it the storage probe
        if not killed:
            killed.append(coord.pool.info()["b"]["pid"])
            os.kill(killed[0], signal.SIGKILL)
        probe(coord)

    monkeypatch.setattr(Coordinator, "_check_storage_reach", kill_then_probe)
    with Coordinator.resume(tmp_path / "run", ["train.steps=3"]) as coord:
        assert coord.restarts == 1 and coord.state.step == 1
        assert killed[0] not in {i["pid"] for i in coord.pool.info().values()}
        coord.run()
    assert without_times(rows(tmp_path / "run")) == without_times(rows(tmp_path / "whole"))


# ---------------------------------------------------------------------------------------- 13: full disk
def test_a_full_disk_names_the_disk_and_the_last_good_checkpoint(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        raw = config(("a",), train={"steps": 50, "checkpoint_every": 1, "keep_checkpoints": 50})
        out = marsi("run", write(tmp_path, raw), "--run-dir", disk / "run")
        assert out.returncode == 2, out.stderr
        last = RunLog(disk / "run").latest_checkpoint()
        assert last is not None and checkpoint_problem(last) is None
        line = out.stderr.strip().splitlines()[-1]
        assert_documented("disk_full", line, exit=out.returncode, RUN=disk / "run")
        assert re.search(r"save failed: .*; disk: [0-4] MB free of 5 MB\)", line), line
        assert f"the last good checkpoint is {last}" in line and f"marsi resume {disk / 'run'}" in line
    finally:
        subprocess.run(["umount", "-l", str(disk)])
