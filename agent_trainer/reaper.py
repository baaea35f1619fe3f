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

A driver that ends normally (its interpreter exits, and Ray's exit handler stops the cluster) says so first:
an exit handler of `watch` writes one line to the watcher's stdin, a pipe only the driver holds. Only a driver
that went without that line is reported on stderr as dead; one that stopped its cluster and exited between two
of the watcher's scans is not, whichever the watcher noticed first.

Limits: Linux only (it reads /proc; elsewhere `watch` starts nothing), and it cannot act if it is killed
itself (say, SIGKILL to every process of the user at once): Ray's agents then end on their own within
about a minute. A cluster marsi joined (`ray.address`) is never touched.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

POLL_S = 0.5
GRACE_S = 10.0  # after ray.shutdown(): how long Ray's own stragglers may take before they are killed

GOODBYE = b"driver exiting\n"

Key = tuple[int, int]  # (pid, start time in clock ticks since boot): one process, never a reused pid


def watch(session_dir: str) -> subprocess.Popen | None:
    """Start the watcher for the cluster whose session directory is `session_dir`, and return once it knows the
    cluster's processes (a driver killed right after this still has its cluster ended); None where there is no /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    proc = subprocess.Popen([sys.executable, "-I", "-S", __file__, str(os.getpid()), session_dir],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    proc.stdout.readline()  # its first scan is done ("" if it ended without one)
    proc.stdout.close()
    threading.Thread(target=proc.wait, name="marsi-ray-reaper", daemon=True).start()  # no zombie when it ends
    atexit.register(_say_goodbye, proc)  # runs before Ray's own exit handler, which was registered at its import
    return proc


def _say_goodbye(proc: subprocess.Popen) -> None:
    """This driver is exiting normally: its cluster is stopped by `ray.shutdown()`, not orphaned."""
    try:
        proc.stdin.write(GOODBYE)
        proc.stdin.flush()
    except (OSError, ValueError):  # the watcher has already exited
        pass


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
class Goodbye:
    """Reads the watcher's stdin: whether the driver said it exits normally. The driver's end of the pipe closes
    when the driver exits, before this process gets its new parent, so once `os.getppid()` changed the answer is
    final (`said`). The file descriptor is read directly: a thread blocked in `sys.stdin`'s buffered reader holds
    its lock, and a watcher exiting while its driver lives (after `ray.shutdown()`) would then die with a fatal
    error at interpreter shutdown."""

    def __init__(self, fd: int):
        self.heard = threading.Event()
        self.reader = threading.Thread(target=self._read, args=(fd,), name="goodbye", daemon=True)
        self.reader.start()

    def _read(self, fd: int) -> None:
        received = b""
        while chunk := os.read(fd, 4096):
            received += chunk
            if GOODBYE in received:
                self.heard.set()
                return

    def said(self) -> bool:
        self.reader.join(timeout=2.0)  # at end of file at once: the driver is gone
        return self.heard.is_set()


def run(driver: int, session_dir: str) -> int:
    """Watch the cluster of `session_dir` started by `driver`; end its processes if the driver dies first."""
    goodbye = Goodbye(sys.stdin.fileno())
    table = process_table()
    roots = cluster_roots(driver, session_dir, table)
    known = with_descendants(roots, table)
    print("scanned", flush=True)  # `watch` returns now: every process of the cluster is known
    while known:
        if os.getppid() != driver:  # the driver is gone: this process has a new parent
            _after_driver(driver, end_all(known), goodbye)
            return 0
        table = process_table()
        known = with_descendants(known, table)
        if not any(alive(r, table) for r in roots):  # ray.shutdown(): Ray stops its own processes
            return _after_shutdown(driver, known, goodbye)
        time.sleep(POLL_S)
    return 0


def _after_shutdown(driver: int, known: set[Key], goodbye: Goodbye) -> int:
    deadline = time.monotonic() + GRACE_S
    while known and time.monotonic() < deadline and os.getppid() == driver:
        time.sleep(POLL_S)
        known = with_descendants(known, process_table())
    count = end_all(known) if known else 0
    if os.getppid() != driver:  # the driver went during the grace period
        _after_driver(driver, count, goodbye)
    return 0


def _after_driver(driver: int, count: int, goodbye: Goodbye) -> None:
    if not goodbye.said():
        _report_orphaned(driver, count)


def _report_orphaned(driver: int, count: int) -> None:
    """One line on stderr once the driver died first, whichever of the cluster's processes went first: Ray's own
    processes often notice a dead driver and end within a poll, leaving nothing to kill."""
    what = f"ended its {count} remaining Ray processes" if count else "its Ray processes had already ended"
    print(f"marsi: the coordinator (pid {driver}) died without stopping its Ray cluster; {what}", file=sys.stderr,
          flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(run(int(sys.argv[1]), sys.argv[2]))
