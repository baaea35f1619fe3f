"""Ends the processes of the local Ray cluster a driver started, when that driver dies without stopping it.

`ray.init()` without an address starts the cluster's processes (GCS server, raylet, dashboard, monitors)
as children of the driver; the raylet starts the agents (DashboardAgent, RuntimeEnvAgent) and the workers
(the trainer actors). A driver that ends normally stops them all (`ray.shutdown()`). A driver killed with
SIGKILL cannot: the GCS server and raylet notice within about two seconds, the workers a few seconds
later, but the two agents stay about a minute, their parent now pid 1.

`watch(session_dir)`, called by the driver right after `ray.init()` started a cluster, runs this file as a
small process in a session of its own (a signal to the driver's process group does not reach it). It knows
the cluster's processes exactly: the driver's children whose command line names the cluster's session
directory, and every descendant of those, each by pid and start time, so a reused pid is never taken for
one of them; `watch` returns once this first scan is done. It rescans twice a second while the driver lives. When the driver is gone it stops (SIGSTOP)
each of them still alive, rescans for children they started meanwhile until none is new, then kills them
all (SIGKILL) and exits. When the cluster's own processes end while the driver lives (`ray.shutdown()`),
it gives any remaining descendant a grace period, kills what is left and exits.

Limits: Linux only (it reads /proc; elsewhere `watch` starts nothing), and it cannot act if it is killed
itself (say, SIGKILL to every process of the user at once): Ray's agents then end on their own within
about a minute. A cluster marsi joined (`ray.address`) is never touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

POLL_S = 0.5
GRACE_S = 10.0  # after ray.shutdown(): how long Ray's own stragglers may take before they are killed

Key = tuple[int, int]  # (pid, start time in clock ticks since boot): one process, never a reused pid


def watch(session_dir: str) -> subprocess.Popen | None:
    """Start the watcher for the cluster whose session directory is `session_dir`, and return once it knows the
    cluster's processes (a driver killed right after this still has its cluster ended); None where there is no /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    proc = subprocess.Popen([sys.executable, "-I", "-S", __file__, str(os.getpid()), session_dir],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True)
    proc.stdout.readline()  # its first scan is done ("" if it ended without one)
    proc.stdout.close()
    threading.Thread(target=proc.wait, name="marsi-ray-reaper", daemon=True).start()  # no zombie when it ends
    return proc


# ------------------------------------------------------------------------------------------- /proc
def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time) of every process now visible."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                table[int(name)] = stat
    return table


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process; None for one that is gone or a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name before ')' may hold spaces
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[19])  # fields 4 (ppid) and 22 (starttime) of proc(5)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(key: Key, table: dict[int, tuple[int, int]]) -> bool:
    return key[0] in table and table[key[0]][1] == key[1]


# ------------------------------------------------------------------------------------------- the tree
def cluster_roots(driver: int, session_dir: str, table: dict[int, tuple[int, int]]) -> set[Key]:
    """The processes `ray.init()` started for the session: children of `driver` naming `session_dir` (but
    for this watcher, also one of them)."""
    return {(pid, start) for pid, (ppid, start) in table.items()
            if ppid == driver and pid != os.getpid() and session_dir in _cmdline(pid)}


def with_descendants(known: set[Key], table: dict[int, tuple[int, int]]) -> set[Key]:
    """`known` (those still alive) and every live descendant of them."""
    found = {k for k in known if alive(k, table)}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo = [pid for pid, _ in found]
    while todo:
        for child in children.get(todo.pop(), []):
            key = (child, table[child][1])
            if key not in found:
                found.add(key)
                todo.append(child)
    return found


def end_all(known: set[Key]) -> int:
    """Stop every live process of `known` and all their descendants, then kill them; how many were killed."""
    stopped: set[Key] = set()
    while True:
        current = {k for k in with_descendants(known | stopped, process_table()) if k[0] != os.getpid()}
        new = current - stopped
        if not new:
            break
        for pid, _ in new:
            _signal(pid, signal.SIGSTOP)  # a stopped process starts no more children
        stopped |= new
    table = process_table()
    doomed = [pid for pid, start in stopped if alive((pid, start), table)]
    for pid in doomed:
        _signal(pid, signal.SIGKILL)
    return len(doomed)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------- the watcher
def run(driver: int, session_dir: str) -> int:
    """Watch the cluster of `session_dir` started by `driver`; end its processes if the driver dies first."""
    table = process_table()
    roots = cluster_roots(driver, session_dir, table)
    known = with_descendants(roots, table)
    print("scanned", flush=True)  # `watch` returns now: every process of the cluster is known
    while known:
        if os.getppid() != driver:  # the driver is gone: this process has a new parent
            _report_orphaned(driver, end_all(known))
            return 0
        table = process_table()
        known = with_descendants(known, table)
        if not any(alive(r, table) for r in roots):  # ray.shutdown(): Ray stops its own processes
            return _after_shutdown(driver, known)
        time.sleep(POLL_S)
    return 0


def _after_shutdown(driver: int, known: set[Key]) -> int:
    deadline = time.monotonic() + GRACE_S
    while known and time.monotonic() < deadline and os.getppid() == driver:
        time.sleep(POLL_S)
        known = with_descendants(known, process_table())
    count = end_all(known) if known else 0
    if os.getppid() != driver:  # the driver died during the grace period
        _report_orphaned(driver, count)
    return 0


def _report_orphaned(driver: int, count: int) -> None:
    """One line on stderr once the driver died first, whichever of the cluster's processes went first: Ray's own
    processes often notice a dead driver and end within a poll, leaving nothing to kill."""
    what = f"ended its {count} remaining Ray processes" if count else "its Ray processes had already ended"
    print(f"marsi: the coordinator (pid {driver}) died without stopping its Ray cluster; {what}", file=sys.stderr,
          flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(run(int(sys.argv[1]), sys.argv[2]))
