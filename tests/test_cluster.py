"""A two-node Ray cluster on one machine whose nodes do not share the run directory's disk.

The head node runs as usual; the worker node runs in a mount namespace of its own with a private tmpfs
over `private/`, the directory that holds the run directory: there it sees an empty filesystem, as a
node of a real cluster without a shared disk would. `shared/` (the storage URI's directory) is seen by
both. Each node has one CPU and the trainers are placed with STRICT_SPREAD, so the two agents run on
the two nodes. Each node gets a TMPDIR of its own (the worker's inside its private tmpfs), where
trainers stage checkpoint files. Teardown stops only the processes this fixture started.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator.coordinator import Coordinator
from orchestrator.runlog import RunLog, checkpoint_problem, read_checkpoint_state
from protocols.config import validate_config
from tests.envs import config
from tests.errors_doc import assert_documented
from tests.runs import marsi, rows, without_times, write

WORKER = "marsi-test-worker"
RAY = Path(sys.executable).parent / "ray"
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}  # a loopback-only test cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _namespaces_work() -> bool:
    if os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /mnt && umount /mnt"], capture_output=True)
    return probe.returncode == 0


_WAIT_FOR_CPUS = """
import sys, time
import ray
from ray._private import ray_constants
from ray.autoscaler._private.commands import debug_status
from ray.experimental import internal_kv

address, wanted = sys.argv[1:]
while True:  # what `ray status --address=ADDRESS` prints, until it names `wanted`
    try:
        client = ray._raylet.GcsClient(address=address)
        internal_kv._initialize_internal_kv(client)
        status = client.internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS.encode())
        error = client.internal_kv_get(ray_constants.DEBUG_AUTOSCALING_ERROR.encode())
        if wanted in debug_status(status, error, address=address):
            break
    except Exception:  # the head is not up yet
        pass
    time.sleep(0.5)
"""


class TwoNodes:
    def __init__(self, base: Path):
        self.base = base
        self.private, self.shared = base / "private", base / "shared"
        self.head_tmp = base / "head-tmp"
        self.worker_tmp = self.private / "tmp"  # inside the worker's tmpfs
        for path in (self.private, self.shared, self.head_tmp):
            path.mkdir()
        self.ray_temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
        self.address = f"127.0.0.1:{_free_port()}"
        env = {**os.environ, **RAY_ENV}
        self.head = subprocess.Popen(
            [str(RAY), "start", "--head", "--block", f"--port={self.address.split(':')[1]}", "--num-cpus=1",
             "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--temp-dir={self.ray_temp}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**env, "TMPDIR": str(self.head_tmp)})
        self.worker = None
        self._wait_for(1)
        script = (f'mount -t tmpfs -o size=256m tmpfs "{self.private}" && mkdir "{self.worker_tmp}" && '
                  f'TMPDIR="{self.worker_tmp}" exec "{RAY}" start --block --address={self.address} --num-cpus=1 '
                  f'--node-ip-address=127.0.0.1 --node-name={WORKER}')
        self.worker = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self._wait_for(2)

    def _wait_for(self, nodes: int) -> None:
        """Until `ray status` would say the cluster has `nodes` CPUs (one per node): one poller process, which
        imports Ray once, rather than a `ray status` (an import of Ray, a second of CPU) every second."""
        poller = subprocess.Popen([sys.executable, "-c", _WAIT_FOR_CPUS, self.address, f"/{float(nodes)} CPU"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, **RAY_ENV})
        deadline = time.time() + 90
        try:
            while poller.poll() is None:
                alive = self.head.poll() is None and (self.worker is None or self.worker.poll() is None)
                assert alive and time.time() < deadline, f"the test cluster did not reach {nodes} nodes"
                time.sleep(0.2)
        finally:
            if poller.poll() is None:
                poller.kill()
            out = poller.communicate()[0]
        assert poller.returncode == 0, f"the test cluster did not reach {nodes} nodes: {out[-1000:]}"

    def env(self) -> dict[str, str]:
        return {"RAY_ADDRESS": self.address, **RAY_ENV}

    def worker_sees(self, path: Path) -> list[str]:
        """Every path under `path` as the worker node sees it (in its mount namespace), but torch's own compile
        cache (`TMPDIR/torchinductor_USER`, made when a process imports parts of torch that want it: not marsi's)."""
        out = subprocess.run(["nsenter", "-t", str(self.worker.pid), "-m", "find", str(path)], capture_output=True,
                             text=True, check=True)
        return sorted(p for p in out.stdout.split() if not TORCH_CACHE.search(p))

    def trainer_pids(self, node: subprocess.Popen) -> list[int]:
        """Trainer actor processes started by `node` (its `ray start` and their descendants)."""
        children: dict[int, list[int]] = {}
        names: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                    names[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                except OSError:
                    continue
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
        found, todo = [], [node.pid]
        while todo:
            pid = todo.pop()
            for child in children.get(pid, []):
                todo.append(child)
                if names.get(child, "").startswith("ray::_TrainerActor"):
                    found.append(child)
        return found

    def stop(self) -> None:
        for proc in (self.worker, self.head):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(self.ray_temp, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    if not _namespaces_work():
        pytest.skip("needs root and mount namespaces (unshare -m) to give the worker node a disk of its own")
    cluster = TwoNodes(tmp_path_factory.mktemp("two-nodes"))
    try:
        yield cluster
    finally:
        cluster.stop()


def cluster_config(**train) -> dict:
    raw = config(ray=True, train={"checkpoint_every": 1, "keep_checkpoints": 2, **train})
    raw["ray"]["placement_strategy"] = "STRICT_SPREAD"  # one trainer per node
    return raw


def named(line: str) -> dict[str, str]:
    """The node and the agent an error line names, as docs/errors.md writes them (NODE, AGENT)."""
    return {"NODE": re.search(rf"node {WORKER} \([0-9.]+, id [0-9a-f]{{12}}\)", line).group(),
            "AGENT": re.search(r"agent '(a|b)'", line).group(1)}


TORCH_CACHE = re.compile(r"/torchinductor_[^/]*(/|$)")
"""torch's compile cache in a node's TMPDIR: torch's to keep, not a file marsi left."""


def leftovers(paths: list[str]) -> list[str]:
    return [p for p in paths if re.search(r"\.tmp-step-|marsi-ckpt-|\.marsi-probe-", p)]


def test_a_run_directory_the_worker_node_does_not_see_is_refused_at_start(two_nodes, tmp_path):
    run_dir = two_nodes.private / "unshared-run"
    out = marsi("run", write(tmp_path, cluster_config(steps=2)), "--run-dir", run_dir, env=two_nodes.env())
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"marsi: error: the run directory {run_dir} is not shared with node {WORKER} \([0-9.]+, "
                        r"id [0-9a-f]{12}\), which hosts agent '(a|b)' \(a file this coordinator wrote there is not "
                        r"visible to it\), so checkpoints would stay on that node; set train.storage to a URI every "
                        r"node reaches .*", line), line
    assert_documented("run_dir_not_shared", line, exit=out.returncode, RUN=run_dir, **named(line))
    assert not run_dir.exists()  # a run that failed to start leaves no directory
    assert two_nodes.worker_sees(two_nodes.private) == [str(two_nodes.private), str(two_nodes.worker_tmp)]


def test_a_storage_path_the_worker_node_does_not_share_is_refused_at_start(two_nodes, tmp_path):
    store = two_nodes.private / "not-shared-store"  # a plain path: as if NFS were mounted on the head only
    out = marsi("run", write(tmp_path, cluster_config(steps=2, storage=str(store))), "--run-dir", tmp_path / "run",
                env=two_nodes.env())
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"marsi: error: train.storage {store} is not the same storage on node {WORKER} \([0-9.]+, id "
                        rf"[0-9a-f]{{12}}\), which hosts agent '(a|b)' \(a file this coordinator wrote to {store}/run/"
                        r"checkpoints is not visible there\); give train.storage a URI or shared path that every node "
                        r"reaches", line), line
    assert_documented("storage_not_shared", line, exit=out.returncode, **{"/mnt/ckpt": store}, **named(line))
    assert leftovers([str(p) for p in store.rglob("*")]) == []
    assert two_nodes.worker_sees(two_nodes.private) == [str(two_nodes.private), str(two_nodes.worker_tmp)]


def test_checkpoints_in_shared_storage_survive_a_killed_trainer_and_a_resume(two_nodes, tmp_path):
    """Two agents on two nodes, checkpoints in a file:// store both nodes share, the run directory on the
    head's disk only: a trainer on the worker node is killed, every trainer restarts from the last
    checkpoint (read in place on each node), `marsi resume` goes on from storage; the metrics are those of an
    uninterrupted single-process run."""
    reference = tmp_path / "reference"
    with Coordinator(validate_config(config(train={"steps": 4, "checkpoint_every": 1})), reference) as coord:
        coord.run()
    store = f"file://{two_nodes.shared}/store"
    raw = cluster_config(steps=3, storage=store)
    raw["environment"]["kwargs"]["delay"] = 0.3  # slow steps, so the kill lands mid-run
    run_dir = two_nodes.private / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", str(write(tmp_path, raw)), "--run-dir",
                             str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **two_nodes.env()})
    try:
        while not (run_dir / "metrics.jsonl").exists() or not rows(run_dir):
            assert proc.poll() is None, proc.communicate()[1]
            time.sleep(0.05)
        on_head, on_worker = two_nodes.trainer_pids(two_nodes.head), two_nodes.trainer_pids(two_nodes.worker)
        assert len(on_head) == 1 and len(on_worker) == 1, (on_head, on_worker)  # one agent on each node
        os.kill(on_worker[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert re.search(r"its process died .*; restarting the trainers from step-00000[0-2] \(restart 1 of 3\)", err), err
    out = marsi("resume", run_dir, "train.steps=4", env=two_nodes.env())
    assert out.returncode == 0, out.stderr
    assert "resuming" in out.stderr and "at step 3" in out.stderr
    assert without_times(rows(run_dir)) == without_times(rows(reference))

    log = RunLog(run_dir)
    assert [c.name for c in log.checkpoints()] == ["step-000003", "step-000004"]
    newest = log.latest_checkpoint()
    assert str(newest) == f"{store}/run/checkpoints/step-000004" and checkpoint_problem(newest) is None
    manifest = read_checkpoint_state(newest)["manifest"]
    for agent in ("a", "b"):
        assert {f"agents/{agent}/model/model.safetensors", f"agents/{agent}/trainer_state.pt"} <= set(manifest)
    assert sorted(p.name for p in (two_nodes.shared / "store" / "run" / "checkpoints").iterdir()) == \
        ["step-000003", "step-000004"]  # nothing uncommitted, no probe left
    assert not (run_dir / "checkpoints").exists()
    # no orphans on either node: staging directories, temporary checkpoint directories, probes
    head_view = [str(p) for p in two_nodes.base.rglob("*")]
    assert leftovers(head_view) == []
    assert [p for p in two_nodes.head_tmp.iterdir() if not TORCH_CACHE.search(str(p))] == []
    assert two_nodes.worker_sees(two_nodes.private) == [str(two_nodes.private), str(two_nodes.worker_tmp)]


def test_a_model_path_missing_on_the_worker_node_names_the_node(two_nodes, tmp_path):
    from agent_trainer.models import resolve_model_path

    model = two_nodes.private / "model"  # on the head's disk only
    shutil.copytree(resolve_model_path("builtin:tiny"), model)
    raw = cluster_config(steps=1, storage=f"file://{two_nodes.shared}/store-model")
    for agent in raw["agents"].values():
        agent["model"] = str(model)
    out = marsi("run", write(tmp_path, raw), "--run-dir", tmp_path / "run", env=two_nodes.env())
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"marsi: error: agent '(a|b)': agents\.(a|b)\.model '{model}' does not exist on node {WORKER} "
                        r"\([0-9.]+, id [0-9a-f]{12}\), which hosts this agent; copy it to that path on every node "
                        r"that may host the agent, or give a hub id or a built-in", line), line
    assert_documented("model_missing_on_node", line, exit=out.returncode, **{"/models/m": model}, **named(line))


def test_forwarded_values_reach_the_trainers_and_no_file(ray_cluster, tmp_path, monkeypatch):
    """`ray.forward_env` values (storage credentials) are set in every trainer's process, and appear in no file under
    Ray's session directory (its runtime_env agent's log among them, which outlives the run), the run directory, the
    store or the report. The variable is set after the session's cluster started, so a trainer has it only if
    marsi forwarded it."""
    import secrets

    import ray

    from orchestrator.report import report

    value = f"marsi-forwarded-{secrets.token_hex(12)}"
    monkeypatch.setenv("MARSI_TEST_SECRET", value)
    raw = config(ray=True, train={"steps": 1, "storage": f"file://{tmp_path}/store"})
    raw["ray"]["forward_env"] = ["MARSI_TEST_SECRET"]
    raw["ray"]["env_vars"] = {"MARSI_TEST_SETTING": "plain"}
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        seen = ray.get([actor.__ray_call__.remote(lambda self: (os.environ.get("MARSI_TEST_SECRET"),
                                                                 os.environ.get("MARSI_TEST_SETTING")))
                        for agent in ("a", "b") for actor in coord.pool.workers[agent]])
        coord.run()
    assert seen == [(value, "plain")] * 2
    report(tmp_path / "run")
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    assert (session / "logs" / "runtime_env_agent.log").is_file()
    leaked = [str(path) for root in (session, tmp_path) for path in root.rglob("*")
              if path.is_file() and not path.is_symlink() and value.encode() in path.read_bytes()]
    assert leaked == []
