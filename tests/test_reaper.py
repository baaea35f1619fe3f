"""A run leaves no process behind: the watcher of agent_trainer/reaper.py ends the local Ray cluster of a
coordinator killed with SIGKILL, and touches nothing else."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import yaml

from agent_trainer.reaper import process_table
from tests.envs import config

MARSI = [sys.executable, "-m", "orchestrator.cli"]

REPO = Path(__file__).resolve().parent.parent
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the watcher reads /proc (Linux)")


def live(pid: int) -> bool:
    """Running, not gone and not a zombie waiting to be reaped."""
    return pid in process_table()


def descendants(pid: int) -> set[int]:
    table = process_table()
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child, (ppid, _) in table.items():
            if ppid == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# A stand-in for a driver that started a Ray cluster: a "cluster process" naming the session directory (with
# a child that does not), an unrelated child, then the watcher. It prints the pids and waits, or with
# "shutdown" ends its cluster process itself first, as ray.shutdown() does, or with "exit" does that and exits
# normally at once, as `marsi run` stopped by a signal while it starts does.
DRIVER = textwrap.dedent("""
    import os, subprocess, sys, time
    sys.path.insert(0, {repo!r})
    from agent_trainer import reaper

    session, mode = sys.argv[1], sys.argv[2]
    ROOT = ("import os, subprocess, sys, time\\n"
            "child, parent = subprocess.Popen(sys.argv[2:]), os.getppid()\\n"
            "while os.getppid() == parent: time.sleep(0.01)\\n"
            "child.kill()")
    sleep = {sleep!r}
    root = subprocess.Popen([sys.executable, "-c", ROOT if mode == "vanish" else
                             "import subprocess, sys, time; subprocess.Popen(sys.argv[2:]); time.sleep(600)",
                             session, *sleep], stderr=subprocess.DEVNULL)
    other = subprocess.Popen(sleep, stderr=subprocess.DEVNULL)  # only the watcher writes to the test's pipe
    while not (grandchild := [pid for pid, (ppid, _) in reaper.process_table().items() if ppid == root.pid]):
        time.sleep(0.1)  # as after ray.init(): the cluster's processes are up
    watcher = reaper.watch(session)
    print(root.pid, grandchild[0], other.pid, watcher.pid, flush=True)
    if mode in ("shutdown", "exit"):  # watch() returned: the watcher has scanned the tree
        root.kill()
        root.wait()
    if mode == "exit":
        sys.exit(0)
    if mode == "vanish":  # the driver dies; its cluster notices and ends itself at once, as Ray's GCS does
        os._exit(0)
    time.sleep(600)
""")


def start_driver(tmp_path, mode: str):
    session = f"/tmp/marsi-test-session-{uuid.uuid4().hex}"
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(repo=str(REPO), sleep=SLEEP))
    driver = subprocess.Popen([sys.executable, str(script), session, mode], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    root, grandchild, other, watcher = map(int, driver.stdout.readline().split())
    return session, driver, root, grandchild, other, watcher


def test_the_watcher_ends_the_cluster_of_a_killed_driver_and_nothing_else(tmp_path):
    session, driver, root, grandchild, other, watcher = start_driver(tmp_path, "wait")
    bystander = subprocess.Popen([*SLEEP, session])  # names the session too, but no driver started it
    try:  # no wait: watch() returned once the watcher had scanned the cluster's tree
        driver.kill()
        driver.wait()
        wait_until(lambda: not live(root) and not live(grandchild), 10, "the cluster processes outlived the driver")
        wait_until(lambda: not live(watcher), 10, "the watcher did not exit")
        assert live(other) and live(bystander.pid), "the watcher killed a process that is not the cluster's"
        assert "ended its 2 remaining Ray processes" in driver.stderr.read()
    finally:
        kill_all([driver.pid, root, grandchild, other, watcher, bystander.pid])
        bystander.wait()


def test_the_watcher_exits_when_the_cluster_is_shut_down_and_the_driver_lives(tmp_path):
    session, driver, root, grandchild, other, watcher = start_driver(tmp_path, "shutdown")
    try:
        wait_until(lambda: not live(root), 10, "the driver did not end its cluster process")
        wait_until(lambda: not live(watcher), 20, "the watcher outlived the cluster")
        assert not live(grandchild)  # a straggler of the cluster is killed after the grace period
        assert driver.poll() is None and live(other)
        kill_all([driver.pid, other])
        driver.wait(timeout=30)
        err = driver.stderr.read()
        assert err == "", err  # the watcher says nothing, and exits cleanly while the driver still holds its stdin
    finally:
        kill_all([driver.pid, root, grandchild, other, watcher])


def test_a_driver_that_stops_its_cluster_and_exits_at_once_is_not_reported_dead(tmp_path):
    """The driver ends between two of the watcher's scans: the watcher finds it gone, but it said goodbye first."""
    session, driver, root, grandchild, other, watcher = start_driver(tmp_path, "exit")
    try:
        assert driver.wait(timeout=30) == 0
        wait_until(lambda: not live(watcher), 20, "the watcher outlived its driver")
        err = driver.stderr.read()
        assert "died without stopping" not in err, err
        assert not live(grandchild) and live(other)  # the straggler is still ended
    finally:
        kill_all([driver.pid, root, grandchild, other, watcher])


def test_the_watcher_says_so_when_the_driver_died_after_its_cluster_ended(tmp_path):
    """Ray's own processes notice a dead driver and may end before the watcher scans again (under load, often): the
    watcher reports the dead driver whichever went first."""
    session, driver, root, _, other, watcher = start_driver(tmp_path, "vanish")
    try:
        driver.wait(timeout=30)
        wait_until(lambda: not live(watcher), 20, "the watcher outlived its driver and cluster")
        err = driver.stderr.read()
        assert re.search(r"died without stopping its Ray cluster; (ended its \d remaining Ray processes|its Ray "
                         r"processes had already ended)", err), err
        assert not live(root) and live(other)
    finally:
        kill_all([driver.pid, root, other, watcher])


def test_a_coordinator_killed_with_sigkill_leaves_no_ray_process(tmp_path):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config(ray=True, train={"steps": 500, "checkpoint_every": 1000})))
    run, tree = tmp_path / "run", set()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}  # a cluster of its own
    proc = subprocess.Popen([*MARSI, "run", str(tmp_path / "run.yaml"), "--run-dir", str(run)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = run / "metrics.jsonl"
    try:
        wait_until(lambda: (metrics.exists() and metrics.read_text().count("\n") >= 1) or proc.poll() is not None,
                   240, "no metrics line within 240 s")
        assert proc.poll() is None, proc.stderr.read()
        tree = descendants(proc.pid)
        names = " ".join(cmdline(p) for p in tree)
        assert "raylet" in names and "ray::DashboardAgent" in names and "reaper.py" in names, names
        session = re.search(r"/(session_[0-9_-]+)", names).group(1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

        def left():
            return sorted(p for p in tree if live(p)) + [p for p in process_table() if session in cmdline(p)]

        wait_until(lambda: not left(), 20, "Ray processes still alive 20 s after the SIGKILL")
        # which went first, the watcher or Ray's own processes, depends on the load: the line names either
        assert re.search(r"died without stopping its Ray cluster; (ended its \d+ remaining Ray processes|its Ray "
                         r"processes had already ended)", proc.stderr.read())
    finally:
        kill_all([proc.pid, *(p for p in tree if live(p))])
