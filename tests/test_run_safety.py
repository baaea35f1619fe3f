"""Attacks on run directories, resume, signals and trainer hangs: each reproduces a way to lose or mix runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
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
from orchestrator.session import Session
from protocols.config import validate_config
from tests.envs import config
from tests.errors_doc import assert_documented, assert_quoted
from tests.runs import MARSI, claim_at_once, marsi, rows, without_times, write

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
    from orchestrator.cli import main

    tmp = tmp_path_factory.mktemp("finished")
    cfg = write(tmp, config(train={"steps": 3, "checkpoint_every": 1, "keep_checkpoints": 5}))
    assert main(["run", str(cfg), "--run-dir", str(tmp / "run")]) == 0  # `marsi run`, in this process
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
    while not (tmp_path / ".transcripts.jsonl.tmp").exists() and proc.poll() is None:
        time.sleep(0.001)
    proc.kill()  # killed mid-rewrite (or, on a fast machine, just after): the file is whole, old or new
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
def test_sigterm_with_ray_stops_after_the_step_with_a_checkpoint(join_ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    raw = config(ray=True, train={"steps": 40})
    proc = subprocess.Popen([*MARSI, "run", str(write(tmp_path, raw)), "--run-dir", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **join_ray_cluster})  # the session's Ray: no cluster start
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
    """One trainer (one process to start, and to restart), a step done and checkpointed."""
    raw = config(("b",), ray=True, train={"steps": 2, "checkpoint_every": 1, "checkpoint_timeout_s": 3,
                                          "max_restarts": 2})
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
    pid = coord.pool.info()["b"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(TrainerFailure, match=r"agent 'b': load failed: no answer within 3s \(hung\)") as caught:
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


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> list[dict]:
    """The metrics of an uninterrupted 2-step run, in-process, a checkpoint every step."""
    from tests.runs import uninterrupted_rows

    return uninterrupted_rows(validate_config(config(train={"steps": 2, "checkpoint_every": 1})),
                              tmp_path_factory.mktemp("two-steps"))


def test_a_trainer_killed_before_the_first_checkpoint_is_restarted(ray_cluster, tmp_path, two_steps):
    raw = config(ray=True, train={"steps": 2, "checkpoint_every": 1})
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        os.kill(coord.pool.info()["b"]["pid"], signal.SIGKILL)  # dies before the step-0 save
        coord.run()
        assert coord.restarts == 1
    assert without_times(rows(tmp_path / "run")) == two_steps


def test_a_trainer_killed_during_the_resume_probe_is_restarted(ray_cluster, tmp_path, monkeypatch, two_steps):
    """A run of 1 step (in-process: only the resume needs Ray's trainers) resumed with Ray to 2 steps; a trainer dies
    as the resumed coordinator sends the storage probe."""
    with Coordinator(validate_config(config(train={"steps": 1, "checkpoint_every": 1})), tmp_path / "run") as coord:
        coord.run()
    probe = Session.check_storage_reach
    killed = []

    def kill_then_probe(session):  # the trainer dies as the coordinator sends it the storage probe
        if not killed:
            killed.append(session.pool.info()["b"]["pid"])
            os.kill(killed[0], signal.SIGKILL)
        probe(session)

    monkeypatch.setattr(Session, "check_storage_reach", kill_then_probe)
    with Coordinator.resume(tmp_path / "run", ["train.steps=2", "ray.enabled=true"]) as coord:
        assert killed and coord.restarts == 1 and coord.state.step == 1
        assert killed[0] not in {i["pid"] for i in coord.pool.info().values()}
        coord.run()
    assert without_times(rows(tmp_path / "run")) == two_steps


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


# ----------------------------------------------------- stored runs (train.storage): one writer, fetches that agree
def stored(steps: int, store, **train) -> dict:
    return config(train={"steps": steps, "checkpoint_every": 1, "keep_checkpoints": 3, "storage": f"file://{store}",
                         **train})


def write_lease(place: Path, **owner) -> None:
    """A lease of the run at `place` as another marsi would have left it (`orchestrator/lease.py`)."""
    now = time.time()
    lease = {"token": "f" * 32, "host": "gpu-node-7", "pid": 4242, "started": "1", "boot": "another-boot",
             "user": "someone", "since": now - 3600, "heartbeat": now, **owner}
    place.mkdir(parents=True, exist_ok=True)
    (place / "lease.json").write_text(json.dumps(lease))


@pytest.mark.parametrize("again", ["the place", "the run directory"])
def test_a_run_directory_behind_its_store_is_brought_up_to_it(tmp_path, capfd, again):
    """Machine A runs steps 1-2, machine B fetches the run and does step 3, A goes on (from the store's place, or
    from its own run directory): A's directory is brought up to step 3 before step 4, so A and the store end with
    every step's record, as an uninterrupted run's."""
    from tests.runs import uninterrupted_rows

    reference = uninterrupted_rows(validate_config(stored(4, tmp_path / "ref-store")), tmp_path / "reference")
    store = tmp_path / "store"
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    with Coordinator(validate_config(stored(2, store)), a) as coord:
        coord.run()
    with Coordinator.resume(f"file://{store}/run", ["train.steps=3"], fetch_to=b) as coord:
        coord.run()
    capfd.readouterr()
    target = f"file://{store}/run" if again == "the place" else a
    with Coordinator.resume(target, ["train.steps=4"], fetch_to=a if again == "the place" else None) as coord:
        assert coord.state.step == 3
        coord.run()
    assert [r["step"] for r in rows(a)] == [1, 2, 3, 4]
    assert without_times(rows(a)) == reference
    assert_quoted(next(line for line in capfd.readouterr().err.splitlines() if "brought them up" in line)
                  .removeprefix("marsi: "), RUN=a, CHECKPOINT="step-000003")
    Coordinator.resume(f"file://{store}/run", fetch_to=tmp_path / "c").close()  # what any later fetch gets
    assert without_times(rows(tmp_path / "c")) == reference
    assert (tmp_path / "c" / "transcripts.jsonl").read_bytes() == (a / "transcripts.jsonl").read_bytes()


def test_a_second_writer_of_a_stored_run_is_refused_naming_the_holder(tmp_path):
    """Two run directories of one name write one place in the store: the second is refused by the run's lease, in
    one line naming the holder, before it changes anything; the first goes on and keeps every checkpoint."""
    store = tmp_path / "store"
    with Coordinator(validate_config(stored(3, store)), tmp_path / "one" / "run") as first:
        first.run(until=1)
        kept = sorted(p.name for p in (store / "run" / "checkpoints").iterdir())
        second = Coordinator(validate_config(stored(3, store)), tmp_path / "two" / "run")
        with pytest.raises(Exception) as info:
            second.start()
        assert_documented("storage_lease_held", info.value, PLACE=f"file://{store}/run", HOST=socket.gethostname(),
                          PID=os.getpid())
        assert not (tmp_path / "two" / "run").exists()
        assert sorted(p.name for p in (store / "run" / "checkpoints").iterdir()) == kept
        first.run()
    assert [c.name for c in RunLog(tmp_path / "one" / "run").checkpoints()] == ["step-000001", "step-000002", "step-000003"]
    assert not (store / "run" / "lease.json").exists()  # given back at the end


def test_two_runs_that_claim_one_place_at_once_get_one_owner(tmp_path):
    """The lease is taken by a create-if-absent: of two coordinators claiming one place in the same instant (before
    either wrote a checkpoint), exactly one gets it, every time."""
    store = f"file://{tmp_path}/store"
    for attempt in range(10):
        logs = [RunLog(tmp_path / f"{who}-{attempt}" / "run", storage=store) for who in ("one", "two")]
        outcome = claim_at_once(logs)
        assert sorted(v == "claimed" for v in outcome.values()) == [False, True], outcome
        assert all("is held by another marsi" in v for v in outcome.values() if v != "claimed")
        for log in logs:
            log.release()


def test_resuming_a_run_whose_holder_still_runs_is_refused_before_anything_is_fetched(tmp_path):
    store = tmp_path / "store"
    with Coordinator(validate_config(stored(3, store)), tmp_path / "run") as first:
        first.run(until=2)
        with pytest.raises(Exception) as info:
            Coordinator.resume(f"file://{store}/run", ["train.steps=6"], fetch_to=tmp_path / "elsewhere")
        assert_documented("storage_lease_held", info.value, PLACE=f"file://{store}/run", HOST=socket.gethostname(),
                          PID=os.getpid())
        assert not (tmp_path / "elsewhere").exists()
        out = marsi("resume", f"file://{store}/run", "train.steps=6", "--run-dir", tmp_path / "elsewhere")
        assert out.returncode == 2 and "is held by another marsi" in last_line(out), out.stderr
        assert not (tmp_path / "elsewhere").exists()
        first.run()
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2, 3]


def test_a_stale_lease_is_taken_over_with_take_over_and_a_gone_local_one_at_once(tmp_path, capfd):
    store = tmp_path / "store"
    with Coordinator(validate_config(stored(1, store)), tmp_path / "run") as coord:
        coord.run()
    place = store / "run"
    write_lease(place, heartbeat=time.time() - 400)  # a run on another machine that died 400 s ago
    with pytest.raises(Exception, match=r"last heartbeat 4[0-9][0-9] s ago\); .* adding --take-over"):
        Coordinator.resume(tmp_path / "run", ["train.steps=2"])
    out = marsi("resume", tmp_path / "run", "train.steps=2", "--take-over")
    assert out.returncode == 0, out.stderr
    took = next(line for line in out.stderr.splitlines() if "took over" in line).removeprefix("marsi: ")
    assert_quoted(took, PLACE=f"file://{place}")
    assert took.endswith("s ago: no heartbeat for over 300 s") and "pid 4242 on gpu-node-7" in took
    assert [r["step"] for r in rows(tmp_path / "run")] == [1, 2]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a marsi on this machine whose process is gone: taken over without --take-over
    from orchestrator.lease import Owner

    me = Owner.me()
    write_lease(place, host=me.host, boot=me.boot, pid=gone.pid, started="0")
    with Coordinator.resume(tmp_path / "run", ["train.steps=3"]) as coord:
        coord.run()
    assert "that process is gone" in capfd.readouterr().err
    write_lease(place, heartbeat=time.time())  # alive elsewhere: --take-over does not take it
    with pytest.raises(Exception, match="is held by another marsi"):
        Coordinator.resume(tmp_path / "run", ["train.steps=4"], take_over=True)


def test_a_run_whose_lease_was_taken_over_stops_at_its_next_checkpoint_and_deletes_nothing(tmp_path):
    store = tmp_path / "store"
    with Coordinator(validate_config(stored(3, store)), tmp_path / "run") as coord:
        coord.run(until=1)
        write_lease(store / "run")  # taken over by another marsi (this one looked dead to it)
        before = sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())
        with pytest.raises(Exception) as info:
            coord.run()
        assert_documented("storage_lease_lost", info.value, PLACE=f"file://{store}/run")
    assert sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file()) == before
    assert json.loads((store / "run" / "lease.json").read_text())["host"] == "gpu-node-7"  # theirs, kept


def test_altered_records_fall_back_and_a_failed_fetch_leaves_no_directory(tmp_path, capfd):
    """A byte flipped in the newest checkpoint's records (same size: only the checksum tells) falls back to the one
    before, as a cut or missing one does; when no checkpoint's records are intact, or the resume is refused after
    the fetch, no run directory is left behind."""
    from tests.runs import uninterrupted_rows

    reference = uninterrupted_rows(validate_config(stored(3, tmp_path / "ref-store")), tmp_path / "reference")
    store = tmp_path / "store"
    with Coordinator(validate_config(stored(3, store)), tmp_path / "run") as coord:
        coord.run()
    place = f"file://{store}/run"
    checkpoints = store / "run" / "checkpoints"
    metrics = checkpoints / "step-000003" / "run" / "metrics.jsonl"
    data = bytearray(metrics.read_bytes())
    data[5] ^= 0x01
    metrics.write_bytes(bytes(data))
    capfd.readouterr()
    with Coordinator.resume(place, fetch_to=tmp_path / "fetched") as coord:
        assert coord.state.step == 2
        coord.run()
    assert_quoted(next(line for line in capfd.readouterr().err.splitlines() if "is damaged" in line)
                  .removeprefix("marsi: "))
    assert without_times(rows(tmp_path / "fetched")) == reference
    # refused after the fetch (another storage): the fetched directory goes again
    with pytest.raises(Exception, match="keeps its checkpoint storage"):
        Coordinator.resume(place, ["train.storage=file:///elsewhere"], fetch_to=tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    out = marsi("resume", place, "train.storage=file:///elsewhere", "--run-dir", tmp_path / "refused")
    assert out.returncode == 2 and not (tmp_path / "refused").exists(), out.stderr
    # every checkpoint's records altered: one line, and no directory
    for record in checkpoints.glob("step-*/run/config.yaml"):
        text = bytearray(record.read_bytes())
        text[0] ^= 0x01
        record.write_bytes(bytes(text))
    with pytest.raises(FileNotFoundError) as info:
        Coordinator.resume(place, fetch_to=tmp_path / "nothing")
    assert_documented("resume_place_records_damaged", info.value, STORE=place)
    assert not (tmp_path / "nothing").exists() and not list(tmp_path.glob(".nothing*"))


def test_a_fetch_cut_short_leaves_no_run_directory_to_resume(tmp_path, monkeypatch):
    """A fetch stopped after its first transcripts segment (Ctrl-C, a lost network) leaves nothing where the run
    directory would be; a directory such a fetch left (an older marsi's) is brought up to the store on resume."""
    from orchestrator import runstore

    store = tmp_path / "store"
    with Coordinator(validate_config(stored(2, store)), tmp_path / "run") as coord:
        coord.run()
    place = f"file://{store}/run"
    whole = (tmp_path / "run" / "transcripts.jsonl").read_bytes()
    append_to = storage.append_to
    calls = []

    def cut(src, out):
        if calls:
            raise KeyboardInterrupt
        calls.append(src)
        return append_to(src, out)

    monkeypatch.setattr(storage, "append_to", cut)
    with pytest.raises(KeyboardInterrupt):
        runstore.fetch_run(runstore.as_place(place), tmp_path / "runs" / "run")
    assert calls and not (tmp_path / "runs").exists()
    monkeypatch.setattr(storage, "append_to", append_to)
    # what an older marsi's cut fetch left: the records of the first segment only, the rest missing
    partial = tmp_path / "partial" / "run"
    shutil.copytree(tmp_path / "run", partial, ignore=shutil.ignore_patterns(".lock"))
    (partial / "transcripts.jsonl").write_bytes(whole[:len(whole) // 3])
    with Coordinator.resume(partial, ["train.steps=2"]) as coord:
        assert coord.state.step == 2
    assert (partial / "transcripts.jsonl").read_bytes() == whole
    # a fetch killed outright leaves its hidden directory, which the next fetch into that place removes
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = tmp_path / "again" / f".run.fetch-{dead.pid}-0000"
    (left / "source").mkdir(parents=True)
    runstore.fetch_run(runstore.as_place(place), tmp_path / "again" / "run")
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["run"]
