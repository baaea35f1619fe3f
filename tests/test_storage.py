"""Checkpoint storage given by URI (train.storage): the same run, resume, damage fallback, pruning and
cleanup as checkpoints in the run directory. A `file://` URI stands for object stores here: trainers see
it as a store they do not mount (`object_store`), so it goes through the same pyarrow.fs staging, upload
and download path as s3:// or gs://. Trainers run in-process here; tests/test_cluster.py runs them on two
Ray nodes that do not share a disk."""

from __future__ import annotations

import json
import tempfile

import pytest

from agent_trainer import storage
from protocols.messages import Location
from orchestrator.coordinator import Coordinator
from orchestrator.resume import ResumeError, check_resume
from orchestrator.runlog import RunDirError, RunLog, checkpoint_problem, read_checkpoint_state
from protocols.config import ConfigError, validate_config
from tests.envs import config
from tests.errors_doc import assert_documented, assert_quoted
from tests.runs import rows, without_times, uninterrupted_rows

STEPS = 4
ON_DISK = storage.on_disk  # what the object_store fixture replaces


def raw_config(**train):
    return config(train={"steps": STEPS, "checkpoint_every": 1, "keep_checkpoints": 2, **train})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Metrics of the run with checkpoints in the run directory."""
    return uninterrupted_rows(validate_config(raw_config()), tmp_path_factory.mktemp("reference"))


@pytest.fixture(autouse=True)
def object_store(monkeypatch):
    """Trainers reach every location as an object store: staged on their node, uploaded, downloaded."""
    monkeypatch.setattr(storage, "on_disk", lambda loc: None)


@pytest.fixture
def node_tmp(tmp_path, monkeypatch):
    """This process's TMPDIR (where trainers stage checkpoint files), empty and watched."""
    path = tmp_path / "node-tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def test_a_run_with_storage_matches_the_run_directory_and_resumes_from_it(tmp_path, node_tmp, reference):
    store = f"file://{tmp_path}/store"
    run_dir = tmp_path / "run"
    with Coordinator(validate_config(raw_config(steps=2, storage=store)), run_dir) as coord:
        coord.run()
    assert not (run_dir / "checkpoints").exists()  # nothing of the checkpoints in the run directory
    log = RunLog(run_dir)  # finds the storage from the run's config.yaml
    assert [str(c) for c in log.checkpoints()] == [f"{store}/run/checkpoints/step-00000{i}" for i in (1, 2)]
    coord = Coordinator.resume(run_dir, ["train.steps=4"])
    with coord:
        assert coord.restored_from == log.latest_checkpoint() and coord.state.step == 2
        coord.run()
    assert without_times(rows(run_dir)) == reference
    newest = log.latest_checkpoint()
    assert isinstance(newest, Location) and checkpoint_problem(newest) is None
    state = read_checkpoint_state(newest)
    for agent in ("a", "b"):
        for name in ("model/model.safetensors", "model/config.json", "trainer_state.pt"):
            assert f"agents/{agent}/{name}" in state["manifest"]
    assert state["sizes"].keys() == state["manifest"].keys()
    on_disk = {p.relative_to(tmp_path / "store/run/checkpoints/step-000004").as_posix()
               for p in (tmp_path / "store/run/checkpoints/step-000004").rglob("*") if p.is_file()}
    assert on_disk == set(state["manifest"]) | {"coordinator.json"}
    assert sorted(p.name for p in (tmp_path / "store/run/checkpoints").iterdir()) == ["step-000003", "step-000004"]
    assert list(node_tmp.iterdir()) == []  # every staging directory was removed


def test_damage_in_storage_is_found_and_resume_falls_back(tmp_path, node_tmp, reference, capfd):
    store = tmp_path / "store"
    run_dir = tmp_path / "run"
    with Coordinator(validate_config(raw_config(steps=3, storage=f"file://{store}", keep_checkpoints=3)), run_dir) as coord:
        coord.run()
    checkpoints = store / "run" / "checkpoints"
    # same size, other bytes: only the checksum on the trainer's node can tell
    weights = checkpoints / "step-000003" / "agents" / "b" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    # cut short: the coordinator sees it by its size, without reading it
    state = checkpoints / "step-000002" / "agents" / "a" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    assert "agents/a/trainer_state.pt does not match its checksum" in checkpoint_problem(Location(f"file://{checkpoints}/step-000002"))
    capfd.readouterr()
    with Coordinator.resume(run_dir, ["train.steps=4"]) as coord:
        assert coord.state.step == 1
        coord.run()
    err = capfd.readouterr().err
    assert ("checkpoint step-000003 is damaged (agents/b/model/model.safetensors does not match its checksum); "
            "falling back to step-000002") in err
    assert "checkpoint step-000002 is damaged (agents/a/trainer_state.pt does not match its checksum (it is 100 bytes" in err
    assert_quoted(next(line for line in err.splitlines() if "step-000003 is damaged" in line).removeprefix("marsi: "))
    assert without_times(rows(run_dir)) == reference
    assert list(node_tmp.iterdir()) == []


def test_what_failed_checkpoints_left_is_removed_at_the_next_commit(tmp_path, node_tmp):
    store = tmp_path / "store"
    run_dir = tmp_path / "run"
    with Coordinator(validate_config(raw_config(steps=1, storage=str(store))), run_dir) as coord:  # a plain path
        coord.run()
        root = store / "run" / "checkpoints"
        (root / "step-000007" / "agents" / "a").mkdir(parents=True)  # an upload cut off: never committed
        (root / "step-000007" / "agents" / "a" / "trainer_state.pt").write_bytes(b"partial")
        stale = node_tmp / f"{storage.STAGING_PREFIX}999999999-x"  # a trainer killed mid-upload (no such pid)
        (stale / "model").mkdir(parents=True)
        assert [c.name for c in coord.log.checkpoints()] == ["step-000000", "step-000001"]
        coord.checkpoint(step=2)
        assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]
        assert list(node_tmp.iterdir()) == []


def test_a_new_run_refuses_a_place_in_storage_that_holds_checkpoints(tmp_path):
    store = f"file://{tmp_path}/store"
    with Coordinator(validate_config(raw_config(steps=1, storage=store)), tmp_path / "one" / "run") as coord:
        coord.run()
    with pytest.raises(RunDirError) as info:
        Coordinator(validate_config(raw_config(steps=1, storage=store)), tmp_path / "two" / "run").start()
    assert_documented("storage_holds_other_run", info.value, **{"/mnt/ckpt": tmp_path / "store"})
    assert not (tmp_path / "two" / "run").exists()
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["run"]


def test_a_resume_keeps_its_storage(tmp_path):
    run_dir = tmp_path / "run"
    raw = raw_config(steps=1, storage=f"file://{tmp_path}/store")
    with Coordinator(validate_config(raw), run_dir) as coord:
        coord.run()
    moved = validate_config({**raw, "train": {**raw["train"], "storage": f"file://{tmp_path}/elsewhere"}})
    with pytest.raises(ResumeError) as info:
        check_resume(moved, validate_config(raw), RunLog(run_dir))
    assert_documented("resume_with_other_storage_uri", info.value,
                      **{"/elsewhere": tmp_path / "elsewhere", "/mnt/ckpt": tmp_path / "store"})


@pytest.mark.parametrize("value, message", [
    ("ftp://host/x", "train.storage: scheme 'ftp' of 'ftp://host/x' is not supported"),
    ("file://relative/x", "train.storage: 'file://relative/x' is not an absolute file URI; write file:///absolute/path"),
    ("s3://", "train.storage: 's3://' names no bucket or host; write s3://bucket/prefix"),
    ("", "train.storage: empty"),
])
def test_storage_values_are_checked(value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(raw_config(storage=value))


def test_a_storage_path_is_made_absolute_against_the_config_file(tmp_path):
    source = tmp_path / "configs" / "run.yaml"
    assert validate_config(raw_config(storage="../ckpt"), source=source).train.storage == str(tmp_path / "ckpt")
    assert validate_config(raw_config(storage="s3://bucket/runs")).train.storage == "s3://bucket/runs"


def test_locations_behave_like_paths_where_the_coordinator_needs_them():
    loc = Location.parse("s3://bucket/prefix/") / "run" / "checkpoints" / "step-000003"
    assert str(loc) == "s3://bucket/prefix/run/checkpoints/step-000003"
    assert loc.name == "step-000003" and loc.parent.name == "checkpoints"
    assert json.loads(json.dumps({"at": str(loc)}))["at"].startswith("s3://")


def test_unusable_storage_is_one_line_before_any_trainer_starts(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    raw = raw_config(steps=1, storage=f"file://{tmp_path}/a-file/store")
    with pytest.raises(storage.StorageError) as info:
        Coordinator(validate_config(raw), tmp_path / "run").start()
    assert_documented("storage_unusable", info.value, **{"/mnt/ckpt": tmp_path / "a-file" / "store"})
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["run directory", "storage"])
def test_a_checkpoint_is_not_committed_without_every_reported_file(tmp_path, where):
    log = RunLog(tmp_path / "run", storage=None if where == "run directory" else f"file://{tmp_path}/store")
    staging = log.staging_path(4)
    report = {"agents/b/trainer_state.pt": ("0" * 64, 12345)}
    with pytest.raises(storage.StorageError) as info:
        log.commit_checkpoint(staging, 4, {"step": 4, "episodes": 0, "data": {}, "baselines": {}}, keep=2, files=report)
    assert_documented("checkpoint_file_missing", info.value, STAGING=staging)
    assert log.checkpoints() == []


def test_a_run_that_fails_to_start_leaves_nothing_in_storage(tmp_path):
    raw = raw_config(steps=1, storage=f"file://{tmp_path}/store")
    raw["agents"]["a"]["generation"]["max_prompt_length"] = 1020  # beyond the model's context: a trainer cannot start
    raw["agents"]["a"]["generation"]["max_completion_length"] = 8
    with pytest.raises(Exception, match="exceed the model's context"):
        Coordinator(validate_config(raw), tmp_path / "run").start()
    assert not (tmp_path / "run").exists() and not (tmp_path / "store").exists()  # nor the store it made


@pytest.mark.parametrize("root", ["path", "file"])
def test_a_commit_record_is_moved_over_the_old_one(tmp_path, root):
    """`commit_bytes` writes beside the place, then moves over it: the new record replaces the old, and
    nothing is left beside it."""
    base = Location.parse(tmp_path) if root == "path" else Location(f"file://{tmp_path}")
    record = base / "checkpoints" / "step-000001" / "coordinator.json"
    storage.commit_bytes(record, b"old")
    storage.commit_bytes(record, b"new")
    assert storage.read_bytes(record) == b"new"
    assert storage.file_sizes(base / "checkpoints") == {"step-000001/coordinator.json": 3}


def test_the_store_alone_resumes_a_run_history_included(tmp_path, node_tmp, reference):
    """With train.storage, each checkpoint carries the run directory's records (config, source, metrics,
    transcripts); with the run directory gone, a resume from the run's place in the store fetches them and
    ends with the metrics of an uninterrupted run, every step's row included."""
    import shutil

    store = f"file://{tmp_path}/store"
    run_dir = tmp_path / "run"
    with Coordinator(validate_config(raw_config(steps=2, storage=store)), run_dir) as coord:
        coord.run()
    manifest = read_checkpoint_state(RunLog(run_dir).latest_checkpoint())["manifest"]
    assert {"run/config.yaml", "run/metrics.jsonl", "run/source/envs.py"} <= set(manifest)
    assert read_checkpoint_state(RunLog(run_dir).latest_checkpoint())["records"]["transcripts.jsonl"]  # as segments
    shutil.rmtree(run_dir)  # the coordinator's machine is gone
    fetched = tmp_path / "elsewhere" / "renamed"
    with Coordinator.resume(f"{store}/run", ["train.steps=4"], fetch_to=fetched) as coord:
        assert coord.state.step == 2
        coord.run()
    assert without_times(rows(fetched)) == reference
    log = RunLog(fetched)  # the run goes on in its place in the store, whatever the new directory's name
    assert [str(c) for c in log.checkpoints()] == [f"{store}/run/checkpoints/step-00000{i}" for i in (3, 4)]
    assert not (tmp_path / "store" / "renamed").exists()
    shutil.rmtree(fetched)
    with Coordinator.resume(f"{store}/run/checkpoints", ["train.steps=4"], fetch_to=fetched) as coord:
        assert coord.state.step == 4  # the newest checkpoint's records: every step, history included
    assert without_times(rows(fetched)) == reference


def test_a_place_without_records_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        Coordinator.resume(f"file://{tmp_path}/store/gone", fetch_to=tmp_path / "run")
    assert_documented("resume_place_without_records", info.value, STORE=f"file://{tmp_path}/store/gone")
    assert not (tmp_path / "run").exists()


def test_a_renamed_run_directory_finds_its_place_in_storage(tmp_path, node_tmp):
    store = f"file://{tmp_path}/store"
    with Coordinator(validate_config(raw_config(steps=1, storage=store)), tmp_path / "run") as coord:
        coord.run()
    (tmp_path / "run").rename(tmp_path / "renamed")
    with Coordinator.resume(tmp_path / "renamed", ["train.steps=2"]) as coord:
        assert coord.state.step == 1 and str(coord.restored_from) == f"{store}/run/checkpoints/step-000001"
    (tmp_path / "renamed" / "store.json").unlink()  # as a run of an older marsi: the place follows the name
    with pytest.raises(FileNotFoundError) as info:
        Coordinator.resume(tmp_path / "renamed")
    assert_documented("resume_renamed_run_dir", info.value, RUN=tmp_path / "renamed", STORE=store)


@pytest.mark.subprocess
def test_every_command_takes_the_runs_place_in_storage(tmp_path):
    """`marsi resume | eval | export | plot | report` given STORAGE/RUN_NAME alone, the run directory gone; a short
    step name (step-1) names a checkpoint; `marsi eval`'s rows go to the store. export runs in a subprocess (its
    only one); the others in this process (tests/inproc.py), their subprocess runs being in test_cli.py,
    test_evaluation.py and test_report.py."""
    import shutil

    from tests.inproc import marsi
    from tests.runs import marsi as subprocess_marsi
    from tests.runs import write
    from tests.test_evaluation import with_eval

    store = f"file://{tmp_path}/store"
    raw = with_eval(raw_config(steps=2, storage=store), episodes_per_sample=1)
    out = marsi("run", write(tmp_path, raw), "--run-dir", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    before = rows(tmp_path / "run")
    shutil.rmtree(tmp_path / "run")
    place = f"{store}/run"
    out = subprocess_marsi("export", place, "--agent", "a", "--out", tmp_path / "model", "--checkpoint", "step-1")
    assert out.returncode == 0 and "at step-000001" in out.stdout, out.stderr
    assert (tmp_path / "model" / "config.json").is_file()
    out = marsi("eval", place, "--checkpoint", "step-2")
    assert out.returncode == 0, out.stderr
    assert [json.loads(line)["checkpoint"] for line in (tmp_path / "store" / "run" / "eval.jsonl").read_text().splitlines()] == ["step-2"]
    out = marsi("report", place, "--out", tmp_path / "report.html")
    assert out.returncode == 0 and (tmp_path / "report.html").is_file(), out.stderr
    out = marsi("plot", place, "--out", tmp_path / "plots")
    assert out.returncode == 0 and (tmp_path / "plots" / "reward.png").is_file(), out.stderr
    out = marsi("resume", place, "train.steps=3", "--run-dir", tmp_path / "again")
    assert out.returncode == 0, out.stderr
    assert f"fetched the run at {place} (step-000002) into {tmp_path / 'again'}" in out.stderr
    assert [r["step"] for r in rows(tmp_path / "again")] == [r["step"] for r in before] + [3, 3]  # a step, its evaluation
    assert (tmp_path / "again" / "eval.jsonl").is_file()  # marsi eval's rows came with it
    assert sorted(p.name for p in (tmp_path / "store" / "run" / "checkpoints").iterdir()) == ["step-000002", "step-000003"]


class _HangingFilesystem:
    """A filesystem that never answers (a bucket behind a network that drops every packet)."""

    def __init__(self, release):
        self.release = release

    def get_file_info(self, target):
        self.release.wait()
        raise OSError("gave up")

    create_dir = open_output_stream = open_input_stream = get_file_info


def test_an_unreachable_store_fails_within_the_deadline_in_one_line(tmp_path, monkeypatch):
    import threading

    release = threading.Event()
    real = storage._filesystem.__wrapped__

    def hanging(root, seconds):
        if root.startswith("gs://"):
            return _HangingFilesystem(release), "no-such-bucket/x"
        return real(root, seconds)

    monkeypatch.setattr(storage, "_filesystem", hanging)
    raw = raw_config(steps=1, storage="gs://no-such-bucket/x", storage_timeout_s=0.2)
    try:
        with pytest.raises(storage.StorageTimeout) as info:
            Coordinator(validate_config(raw), tmp_path / "run").start()
    finally:
        release.set()
    assert_documented("storage_no_answer", info.value)
    assert not (tmp_path / "run").exists()


def test_a_location_carries_its_deadline_to_what_is_made_from_it_and_to_a_trainer(tmp_path):
    """The store's deadline belongs to the run, not to the process: every location a run hands out carries it, through
    the requests a trainer is sent, and two runs in one process keep their own."""
    import pickle

    from protocols.messages import LoadRequest

    loc = Location.parse(tmp_path, deadline_s=0.5)
    assert (loc / "a" / "b").parent.deadline_s == 0.5 and loc == Location.parse(tmp_path)  # equal: the same place
    sent = pickle.loads(pickle.dumps(LoadRequest(source=loc / "agents" / "a")))  # as Ray sends it
    assert sent.source.deadline_s == 0.5
    short = RunLog(tmp_path / "short", storage=f"file://{tmp_path}/store", deadline_s=3.0)
    patient = RunLog(tmp_path / "patient", deadline_s=None)
    assert short.checkpoint_dir().deadline_s == 3.0 and patient.checkpoint_dir().deadline_s is None
    with Coordinator(validate_config(raw_config(steps=1, storage_timeout_s=7.0)), tmp_path / "run") as coord:
        coord.run()
    assert RunLog(tmp_path / "run").checkpoint_dir().deadline_s == 7.0  # read back from the run's config.yaml
    assert RunLog(tmp_path / "short").checkpoint_dir().deadline_s == 120.0  # no config: the default


def test_a_full_store_is_named_with_its_free_space(tmp_path, node_tmp, monkeypatch):
    """The message of a checkpoint that could not be written names the store's disk, not the run directory's."""
    import errno

    monkeypatch.setattr(storage, "on_disk", ON_DISK)  # a file:// store: the coordinator measures its disk

    store = f"file://{tmp_path}/store"
    with Coordinator(validate_config(raw_config(steps=1, storage=store)), tmp_path / "run") as coord:
        coord.run()
        full = OSError(errno.ENOSPC, "No space left on device")
        assert coord.log.disk_full(full, checkpoint=True)
        problem = coord.log.disk_problem(full, checkpoint=True)
    assert_documented("storage_full", f"marsi: error: {problem}", RUN=tmp_path / "run", STORE=store)


def test_a_node_that_cannot_reach_the_store_is_named_and_the_coordinator_side_said(tmp_path, monkeypatch):
    """The start-up probe on a trainer's node fails to reach the store (no route, no credentials there) while the
    coordinator wrote its probe file: one line names the node and says which side reached the store."""
    store = f"file://{tmp_path}/store"
    coord = Coordinator(validate_config(raw_config(steps=1, storage=store)), tmp_path / "run")
    with coord:
        read = storage.read_bytes

        def unreachable(loc):
            if loc.name.startswith(storage.PROBE_PREFIX):
                raise OSError("When reading information for key 'x' in bucket 'b': AWS Error NETWORK_CONNECTION: "
                              "Could not resolve host")
            return read(loc)

        monkeypatch.setattr(storage, "read_bytes", unreachable)
        monkeypatch.setattr(coord.config.ray, "enabled", True)  # the probe runs for trainers that may be elsewhere
        with pytest.raises(storage.StorageError) as info:
            coord.session.check_storage_reach()
    assert_documented("storage_unreached_from_node", info.value, STORE=store, NODE="its node", AGENT="a")


def test_transcripts_go_up_as_the_bytes_appended_since_the_last_checkpoint(tmp_path, node_tmp):
    """Each checkpoint lists the transcripts as segments: the previous checkpoint's, then one new segment of what
    the step appended; the store holds the segments kept checkpoints list, no other; a run fetched from the
    store has the transcripts byte for byte."""
    import shutil

    from orchestrator import runstore

    store = tmp_path / "store"
    run_dir = tmp_path / "run"
    with Coordinator(validate_config(raw_config(steps=2, storage=f"file://{store}", keep_checkpoints=2)), run_dir) as coord:
        coord.run()
        one, two = (read_checkpoint_state(c)["records"]["transcripts.jsonl"] for c in coord.log.checkpoints())
        segments = store / "run" / "records" / "transcripts.jsonl"
        (segments / ("0" * 64)).write_bytes(b"left by a checkpoint that failed")
        coord.checkpoint(step=3)  # as a step would: nothing appended since step 2
    log = RunLog(run_dir)
    three = read_checkpoint_state(log.latest_checkpoint())["records"]["transcripts.jsonl"]
    local = (run_dir / "transcripts.jsonl").read_bytes()
    assert len(one) == 1 and two[:-1] == one and three == two  # step 2 added one segment; step 3 none
    assert two[-1][1] == len(local) - one[0][1]  # only the bytes step 2 appended went up
    assert b"".join((segments / digest).read_bytes() for digest, _ in three) == local
    assert sorted(p.name for p in segments.iterdir()) == sorted(d for d, _ in two)  # the stray one is gone
    shutil.rmtree(run_dir)
    runstore.fetch_run(Location(f"file://{store}/run"), tmp_path / "fetched")
    assert (tmp_path / "fetched" / "transcripts.jsonl").read_bytes() == local
    (segments / two[-1][0]).write_bytes(b"other bytes")
    assert checkpoint_problem(log.checkpoints()[-1]) == f"records/transcripts.jsonl/{two[-1][0]} is cut short"


@pytest.mark.parametrize("uri, shown", [
    ("s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/runs", "s3://***@bucket/runs"),
    ("s3://bucket/runs?access_key=AKIAEXAMPLE&secret_key=wJalrXUtnFEMI", "s3://bucket/runs?access_key=***&secret_key=***"),
    ("abfs://container:wJalrXUtnFEMI@account.dfs.core.windows.net/runs", "abfs://***@account.dfs.core.windows.net/runs"),
])
def test_credentials_in_a_storage_uri_are_refused_and_never_written(tmp_path, uri, shown):
    """A storage URI that carries credentials is refused before anything is written (config.yaml, store.json, the
    store and reports would keep them); the message hides them. So is a run's place given with them."""
    from protocols.config import load_config
    from tests.runs import marsi, write

    source = write(tmp_path, raw_config(storage=uri))
    with pytest.raises(ConfigError) as info:
        load_config(source)
    assert "wJalrXUtnFEMI" not in str(info.value) and f"train.storage: {shown!r} holds credentials" in str(info.value)
    if shown != "s3://***@bucket/runs":
        return
    assert_documented("storage_credentials", info.value, **{"<tmp>": tmp_path})
    away = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_EC2_METADATA_DISABLED": "true"}  # no store is reached
    out = marsi("resume", "s3://bucket/runs/run?secret_key=wJalrXUtnFEMI", "--run-dir", tmp_path / "run", env=away)
    assert "wJalrXUtnFEMI" not in out.stderr
    assert_documented("place_credentials", out.stderr.strip().splitlines()[-1], exit=out.returncode)
    assert not (tmp_path / "run").exists()
