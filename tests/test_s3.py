"""Checkpoints and run state in S3 for real: an S3 server emulated on this machine by moto's server mode (no network),
reached by pyarrow's S3 client as a real bucket is (`train.storage=s3://bucket/prefix`, the endpoint given by
AWS_ENDPOINT_URL as a MinIO or a cloud's S3-compatible store would be). A run checkpoints there, its run directory is
deleted, and `marsi resume s3://bucket/prefix/RUN_NAME` ends with the metrics of an uninterrupted run; a failed start
leaves no key below the prefix (S3's directory markers included); bad credentials and an endpoint that never answers
fail in one line within the deadline."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
    pytest.skip("moto[server] is not installed (pip install -e '.[test]')", allow_module_level=True)

from agent_trainer import storage  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402
from protocols.config import validate_config  # noqa: E402
from tests.envs import config  # noqa: E402
from tests.errors_doc import assert_documented  # noqa: E402
from tests.runs import marsi, rows, uninterrupted_rows, without_times  # noqa: E402

BUCKET = "bucket"
STEPS = 4


def raw_config(**train):
    return config(train={"steps": STEPS, "checkpoint_every": 1, "keep_checkpoints": 2, **train})


@pytest.fixture(scope="module")
def s3():
    """An S3 endpoint on this machine with one bucket; this process's AWS_* variables point at it (a subprocess
    inherits them). Yields the endpoint URL."""
    import boto3

    # moto's server in a process of its own: in this one, its Flask globals would be met by libraries that walk
    # every loaded module's attributes (vLLM's CPU kernel registry does, and a Flask proxy raises on hasattr)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"moto's S3 server did not start on {endpoint}")
            time.sleep(0.2)
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    storage._filesystem.cache_clear()  # clients are made once per root, with the environment of that moment
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    try:
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        storage._filesystem.cache_clear()
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture
def clients():
    """S3 clients built afresh for the test, and again after it (its environment changes go with it)."""
    storage._filesystem.cache_clear()
    yield
    storage._filesystem.cache_clear()


def keys(endpoint: str, prefix: str) -> list[str]:
    """Every key below `prefix/` in the bucket, S3's directory markers (keys ending in '/') included."""
    import boto3

    listing = boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listing.get("Contents", []))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Metrics of the run with checkpoints in the run directory."""
    return uninterrupted_rows(validate_config(raw_config()), tmp_path_factory.mktemp("reference"))


@pytest.mark.subprocess
def test_marsi_resume_from_s3_alone_matches_an_uninterrupted_run(tmp_path, s3, clients, reference):
    store = f"s3://{BUCKET}/resume"
    run_dir = tmp_path / "run"
    with Coordinator(validate_config(raw_config(steps=2, storage=store)), run_dir) as coord:
        coord.run()
    assert not (run_dir / "checkpoints").exists()
    committed = [k for k in keys(s3, "resume/") if k.endswith("coordinator.json")]
    assert committed == [f"resume/run/checkpoints/step-00000{i}/coordinator.json" for i in (1, 2)]
    manifest = json.loads(storage.read_bytes(storage.Location(f"{store}/run/checkpoints/step-000002/coordinator.json")))
    assert {"run/config.yaml", "run/metrics.jsonl", "run/source/envs.py"} <= set(manifest["manifest"])
    shutil.rmtree(run_dir)  # the coordinator's machine is gone

    out = marsi("resume", f"{store}/run", "train.steps=4", "--run-dir", tmp_path / "again")
    assert out.returncode == 0, out.stderr
    assert f"fetched the run at {store}/run (step-000002) into {tmp_path / 'again'}" in out.stderr
    assert without_times(rows(tmp_path / "again")) == reference  # history included
    committed = [k for k in keys(s3, "resume/") if k.endswith("coordinator.json")]
    assert committed == [f"resume/run/checkpoints/step-00000{i}/coordinator.json" for i in (3, 4)]
    assert not any("/.marsi-probe-" in k or k.endswith(".tmp") for k in keys(s3, "resume/"))


@pytest.mark.parametrize("before", ["nothing", "another run"])
def test_a_failed_start_leaves_no_key_in_s3(tmp_path, s3, clients, before):
    """No key of the run's place (`PREFIX/run/`, `PREFIX/run/checkpoints/`) stays behind, and when this run made the
    prefix, no key below it at all (its directory marker included). Where the prefix held another run, pyarrow's S3
    client puts back the prefix's own directory marker (`PREFIX/`) whenever it deletes something below it; that key
    lists as the directory the other run's keys make anyway."""
    prefix = f"failed-{before.replace(' ', '-')}"
    if before == "another run":
        storage.write_bytes(storage.Location(f"s3://{BUCKET}/{prefix}/other/checkpoints/step-000001/coordinator.json"), b"{}")
    held = keys(s3, f"{prefix}/")
    raw = raw_config(steps=1, storage=f"s3://{BUCKET}/{prefix}")
    raw["agents"]["a"]["generation"]["max_prompt_length"] = 1020  # beyond the model's context: a trainer cannot start
    raw["agents"]["a"]["generation"]["max_completion_length"] = 8
    with pytest.raises(Exception, match="exceed the model's context"):
        Coordinator(validate_config(raw), tmp_path / "run").start()
    assert not (tmp_path / "run").exists()
    left = keys(s3, f"{prefix}/")
    assert not [k for k in left if k.startswith(f"{prefix}/run")]
    assert left == held if before == "nothing" else set(left) - set(held) <= {f"{prefix}/"}


def test_bad_credentials_fail_in_one_line(tmp_path, s3, clients, monkeypatch):

    def require_credentials(count: str) -> None:  # moto's switch: after `count` requests, check every signature
        urllib.request.urlopen(urllib.request.Request(f"{s3}/moto-api/reset-auth", data=count.encode(), method="POST",
                                                      headers={"Content-Type": "text/plain"}))

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
    require_credentials("0")
    try:
        with pytest.raises(storage.StorageError) as info:
            Coordinator(validate_config(raw_config(steps=1, storage=f"s3://{BUCKET}/denied", storage_timeout_s=30)),
                        tmp_path / "run").start()
    finally:
        require_credentials("inf")
    message = str(info.value)
    assert "\n" not in message and f"train.storage s3://{BUCKET}/denied: cannot use s3://{BUCKET}/denied/run/checkpoints" in message
    assert "credentials" in message
    assert_documented("storage_unusable", info.value, **{"file:///mnt/ckpt": f"s3://{BUCKET}/denied"})
    assert not (tmp_path / "run").exists()
    assert keys(s3, "denied/") == []


@pytest.mark.parametrize("endpoint", ["silent", "refused"])
def test_an_unreachable_s3_endpoint_fails_in_one_line(tmp_path, s3, clients, monkeypatch, endpoint):
    """An endpoint that takes connections and never answers (a firewall that drops packets: only the deadline ends
    the wait), and one where nothing listens."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    if endpoint == "silent":
        listener.listen(64)
    port = listener.getsockname()[1]
    if endpoint == "refused":
        listener.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(storage.StorageError) as info:
            Coordinator(validate_config(raw_config(steps=1, storage=f"s3://{BUCKET}/away", storage_timeout_s=2)),
                        tmp_path / "run").start()
    finally:
        listener.close()
    message = str(info.value)
    assert "\n" not in message and f"s3://{BUCKET}/away" in message, message
    if isinstance(info.value, storage.StorageTimeout):
        what = message.split(" did not answer")[0].removeprefix("storage: ")  # the first call that hung: open or list
        assert what in (f"opening s3://{BUCKET}/away", f"listing s3://{BUCKET}/away"), message
        assert_documented("storage_no_answer", info.value, **{"listing gs://no-such-bucket/x": what, "0.2 s": "2 s"})
    else:
        assert_documented("storage_unusable", info.value, **{"file:///mnt/ckpt": f"s3://{BUCKET}/away"})
    assert not (tmp_path / "run").exists()


def test_the_runs_lease_in_s3_goes_to_one_of_two_writers_and_back(tmp_path, s3, clients, monkeypatch):
    """The lease is taken with S3's conditional put (If-None-Match: *): of two coordinators claiming one place in the
    same instant exactly one gets it; its heartbeat is a put If-Match its ETag, so a lease another marsi wrote over
    is found lost; a released lease leaves no key."""
    import boto3

    from orchestrator.runlog import RunLog
    from tests.runs import claim_at_once

    store = f"s3://{BUCKET}/leased"
    for attempt in range(5):
        logs = [RunLog(tmp_path / f"{who}-{attempt}" / "run", storage=store) for who in ("one", "two")]
        outcome = claim_at_once(logs)
        assert sorted(v == "claimed" for v in outcome.values()) == [False, True], outcome
        assert all("is held by another marsi" in v for v in outcome.values() if v != "claimed")
        holder = next(log for log in logs if outcome[log] == "claimed")
        holder.lease.confirm()  # a heartbeat: the conditional put on the ETag it wrote
        if attempt == 0:
            boto3.client("s3", endpoint_url=s3).put_object(Bucket=BUCKET, Key="leased/run/lease.json", Body=b"{}")
            with pytest.raises(Exception, match="this run no longer holds the run's lease: it was overwritten"):
                holder.lease.confirm()
            boto3.client("s3", endpoint_url=s3).delete_object(Bucket=BUCKET, Key="leased/run/lease.json")
        for log in logs:
            log.release()
        assert [k for k in keys(s3, "leased/") if not k.endswith("/")] == []


def test_a_lease_in_s3_without_boto3_is_said_to_be_not_atomic(tmp_path, s3, clients, monkeypatch, capsys):
    """Without boto3 an S3 lease is written and read back (no conditional put): taking it says so, with the extra
    that makes it atomic; with boto3 it says nothing."""
    from agent_trainer import conditional
    from orchestrator.runlog import RunLog

    log = RunLog(tmp_path / "with" / "run", storage=f"s3://{BUCKET}/with-boto3")
    log.claim(resume=False)
    assert conditional.atomic(log.lease.where) and "atomically" not in capsys.readouterr().err
    log.release()
    storage._filesystem.cache_clear()  # a client made afresh, on a machine where `import boto3` fails
    monkeypatch.setitem(sys.modules, "boto3", None)
    log = RunLog(tmp_path / "without" / "run", storage=f"s3://{BUCKET}/without-boto3")
    log.claim(resume=False)
    err = capsys.readouterr().err
    assert not conditional.atomic(log.lease.where)
    assert "is written and read back, not taken atomically (pip install 'marsi[s3]'" in err, err
    log.release()
