"""The sandbox against hostile programs: real subprocesses, no mocks. Each hostile run must fail with a clear
reason, within its time limit, leaving the test process alive and nothing running or written behind."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import shutil
import socket as sockets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from orchestrator import sandbox
from orchestrator.sandbox import SANDBOX_UIDS, SandboxResult, run_python, sandbox_available
from tests.errors_doc import assert_documented
from tests.hosts import run_as, user_namespaces_work

REPO = Path(__file__).resolve().parents[1]
LAYERS = sandbox._layers()
OS_LAYERS = bool(LAYERS.unshare) and LAYERS.drop_uid


def sandbox_processes(uids=SANDBOX_UIDS) -> list[int]:
    """Processes (zombies included) running as any of `uids` (by default every sandbox uid; a test passes the
    uid its own run printed, since other runs on this host, tests running beside this one, lease others)."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:  # exited meanwhile
            continue
        if int(status.split("\nUid:\t")[1].split()[0]) in uids:
            found.append(int(name))
    return found


def assert_contained(result: SandboxResult, reason: str, max_seconds: float) -> None:
    assert result.ok is False
    assert reason in result.reason, result
    assert result.seconds < max_seconds, result
    os.kill(os.getpid(), 0)  # still here


def test_layers_are_described():
    text = sandbox_available()
    assert "audit hook" in text and "rlimits" in text
    assert ("namespaces: network" in text) == bool(LAYERS.unshare)
    assert text.endswith("containment: as documented") == (not LAYERS.missing)


def test_a_probe_answered_by_another_python_says_which_and_why():
    # as a leased uid, a Python installed under /root (pyenv) loads the system's libpython: the probe then
    # answers with that version, which the uid layer's reason names
    layers = sandbox._Layers(unshare=(), setpriv="/usr/bin/setpriv", drop_uid=True)
    reason = sandbox._other_python("3.11.2 (main, Apr 28 2025, 14:11:48) [GCC 12.2.0]\n", layers)
    assert reason == (f"as a leased uid, {sandbox._PYTHON} ran as Python 3.11.2, not {sys.version.split()[0]} as "
                      "here: that uid cannot read all of this Python's files, e.g. its libpython")
    assert sandbox._other_python("", dataclasses.replace(layers, drop_uid=False)) == (
        f"{sandbox._PYTHON} printed no version (here it is {sys.version.split()[0]})")


def test_correct_program_and_stdin():
    result = run_python("print(sum(range(10)))")
    assert result == SandboxResult(ok=True, reason="", stdout="45\n", stderr="", returncode=0, seconds=result.seconds)
    assert run_python("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"


def test_exception_names_its_type():
    result = run_python("def f():\n    return undefined_name\nf()")
    assert_contained(result, "NameError", 10)
    assert result.reason.startswith("exit code 1: NameError: name 'undefined_name' is not defined")
    assert result.returncode == 1 and "main.py" in result.stderr


def test_humaneval_style_check():
    program = '''
from typing import List
import asyncio, collections, functools, hashlib, heapq, itertools, json, math, multiprocessing, random, re, string
import subprocess, tempfile, uuid

def double_all(xs: List[int]) -> List[int]:
    """Double every element."""
    return [2 * x for x in xs]

def check(candidate):
    assert candidate([1, 2]) == [2, 4]
    assert candidate([]) == []

check(double_all)
'''
    assert run_python(program).ok
    wrong = run_python(program.replace("2 * x", "x + 1"))
    assert_contained(wrong, "AssertionError", 10)


def test_infinite_loop_times_out():
    start = time.monotonic()
    result = run_python("while True: pass", timeout_s=1)
    assert_contained(result, "timeout after 1.0s", 3)
    assert result.returncode is None and time.monotonic() - start < 3


@pytest.mark.skipif(os.geteuid() == 0 and not LAYERS.drop_uid, reason="RLIMIT_NPROC does not apply to root")
def test_fork_bomb_is_contained_and_reaped():
    bomb = "import os\nprint(os.getuid(), flush=True)\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(bomb, timeout_s=2, max_processes=16)
    assert_contained(result, "timeout", 5)
    uids = [int(result.stdout.split()[0])] if LAYERS.drop_uid else SANDBOX_UIDS  # the uid this run leased
    deadline = time.monotonic() + 2  # without a pid namespace, the host's init reaps the killed children
    while sandbox_processes(uids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(uids) == []


@pytest.mark.skipif(not (LAYERS.unshare or LAYERS.drop_uid), reason="needs the pid namespace or the uid layer")
def test_daemonized_child_does_not_outlive_the_run():
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(os.getuid(), 'done')"
    result = run_python(program, timeout_s=5)
    assert result.ok and result.stdout.endswith(" done\n") and result.seconds < 3
    assert sandbox_processes([int(result.stdout.split()[0])] if LAYERS.drop_uid else SANDBOX_UIDS) == []


@pytest.mark.parametrize("program", ["x = bytearray(4 * 1024**3)",
                                     "x = []\nwhile True:\n    x.append(bytearray(1 << 20))"])
def test_memory_hog_hits_the_memory_limit(program):
    assert_contained(run_python(program, memory_mb=256, timeout_s=10), "memory limit", 10)


@pytest.mark.parametrize("target", ["/tmp/marsi_escape_test", str(REPO / "marsi_escape_test")])
def test_writing_outside_the_scratch_directory_fails(target):
    result = run_python(f"open({target!r}, 'w').write('x')")
    assert_contained(result, "forbidden: writing outside the scratch directory", 10)
    assert not Path(target).exists()


@pytest.mark.skipif(not OS_LAYERS, reason="needs the namespace and uid layers")
def test_os_layers_hold_when_the_audit_hook_is_bypassed():
    # the hook resolves "escape" against the working directory, so a dir_fd write slips past it
    code = ("import os\nfd = os.open('/tmp', os.O_RDONLY)\n"
            "os.open('marsi_escape_test', os.O_WRONLY | os.O_CREAT, dir_fd=fd)")
    result = run_python(code)
    assert_contained(result, "exit code 1: ", 10)
    assert "Read-only file system" in result.reason or "Permission denied" in result.reason
    assert not Path("/tmp/marsi_escape_test").exists()


def test_writing_inside_the_scratch_directory_works_and_is_removed():
    code = ("import os, tempfile\nopen('out.txt', 'w').write('hello')\nos.mkdir('sub')\n"
            "with tempfile.NamedTemporaryFile(dir='sub') as f:\n    f.write(b'x')\n"
            "print(os.getcwd())\nprint(open('out.txt').read())")
    result = run_python(code)
    assert result.ok, result
    scratch, content = result.stdout.split()
    assert content == "hello" and not os.path.exists(scratch)


@pytest.mark.parametrize("program", ["import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
                                     "import socket\nsocket.socket()"])
def test_network_is_refused(program):
    assert_contained(run_python(program), "forbidden: network", 10)


def test_parent_environment_does_not_leak(monkeypatch):
    monkeypatch.setenv("MARSI_SECRET", "hunter2")
    result = run_python("import os\nprint(dict(os.environ))")
    assert result.ok
    assert "hunter2" not in result.stdout and "MARSI_SECRET" not in result.stdout


@pytest.mark.parametrize("target", ["parent", "caller"])
def test_killing_the_caller_fails(target):
    pid = "os.getppid()" if target == "parent" else str(os.getpid())  # the sandbox's parent; this test's process
    result = run_python(f"import os, signal\nos.kill({pid}, signal.SIGKILL)")
    assert_contained(result, "forbidden: signalling other processes", 10)


def test_printing_gigabytes_hits_the_output_limit():
    result = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 1_000_000)", max_output_bytes=10_000)
    assert_contained(result, "output limit", 5)
    assert result.reason == "output limit" and len(result.stdout) <= 10_000 and result.returncode is None


def test_starting_programs_and_ctypes_are_refused():
    assert_contained(run_python("import subprocess\nsubprocess.run(['true'])"), "forbidden: starting programs", 10)
    assert_contained(run_python("import os\nos.system('true')"), "forbidden: starting programs", 10)
    direct = run_python("import _posixsubprocess\n_posixsubprocess.fork_exec()")
    assert_contained(direct, "forbidden: starting programs", 10)
    assert_contained(run_python("import ctypes"), "forbidden: native code", 10)


def test_file_size_limit():
    result = run_python("open('big', 'wb').write(b'x' * (2 << 20))", max_file_mb=1)
    assert_contained(result, "file size limit", 10)


def test_reimporting_posixsubprocess_is_refused():
    # a fresh import of the module skips the sandbox's patched fork_exec; the hook names the attempt
    code = "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess"
    assert_contained(run_python(code), "forbidden: starting programs (import _posixsubprocess)", 10)


# ------------------------------------------------------------------- the OS layers without the audit hook
SECRET = "hunter2-marsi-secret"

# Every attack of issue 14, with the audit hook left out: read the caller's environment and private files,
# write outside the scratch directory (a world-writable directory, /dev), signal the caller and everyone,
# connect to the caller's TCP port and abstract unix socket, start a program (subprocess: fork_exec) that
# tries again from sh, leave SysV IPC objects and a POSIX message queue, and leave a setsid daemon running.
HOSTILE = r'''
import ctypes, json, os, signal, socket, subprocess, sys, time

job = json.loads(sys.stdin.read())
caller, key, name = job["caller"], job["key"], job["name"]
outcomes, loot = {}, []

def attempt(what, action):
    try:
        outcomes[what] = ("done: %r" % (action(),))[:200]
    except BaseException as exc:
        outcomes[what] = ("failed: %s: %s" % (type(exc).__name__, exc))[:200]

def read(path):
    with open(path, "rb") as f:
        loot.append(f.read().decode("latin-1"))

attempt("environ of the caller", lambda: read("/proc/%d/environ" % caller))
attempt("environ of the parent", lambda: read("/proc/%d/environ" % os.getppid()))
for pid in filter(str.isdigit, os.listdir("/proc")):
    attempt("environ of %s" % pid, lambda: read("/proc/%s/environ" % pid))
for i, path in enumerate(job["secrets"]):
    attempt("secret %d" % i, lambda: read(path))
for i, where in enumerate(job["outside"]):
    attempt("write %d" % i, lambda: open(os.path.join(where, name), "w").write("x"))
    attempt("mkdir %d" % i, lambda: os.mkdir(os.path.join(where, name + "-dir")))
attempt("signal the caller", lambda: os.kill(caller, signal.SIGKILL))
attempt("signal everyone", lambda: os.kill(-1, signal.SIGKILL))
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", job["port"]), timeout=1))
attempt("unix", lambda: socket.socket(socket.AF_UNIX).connect(job["abstract"]))
shell = "cat /proc/%d/environ; kill -9 %d; " % (caller, caller) + "".join(
    "echo x > %s/%s-sh; " % (where, name) for where in job["outside"])
attempt("shell", lambda: loot.append(subprocess.run(["/bin/sh", "-c", shell], capture_output=True, text=True).stdout))

libc, IPC_CREAT, size = ctypes.CDLL(None, use_errno=True), 0o1000, 64 << 20
libc.shmat.restype = ctypes.c_void_p
ipc = [libc.shmget(key + i, size, IPC_CREAT | 0o600) for i in range(3)]
for shmid in ipc:  # touched: the pages are really held
    address = libc.shmat(shmid, None, 0)
    ctypes.memset(address, 1, size)
    libc.shmdt(ctypes.c_void_p(address))
ipc += [libc.msgget(key + 3, IPC_CREAT | 0o600), libc.semget(key + 4, 1, IPC_CREAT | 0o600)]
ipc.append(ctypes.CDLL("librt.so.1").mq_open(("/" + name).encode(), os.O_CREAT | os.O_RDWR, 0o600, None))
outcomes["ipc"] = ipc

if os.fork() == 0:  # a daemon: its own session, still holding the output pipes
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
print(json.dumps({"outcomes": outcomes, "loot": loot, "scratch": os.getcwd()}))
'''

# The caller when it is not root: runs HOSTILE in the sandbox and reports how it ended.
_HOSTILE_CALLER = r'''
import dataclasses, json, os, sys
from orchestrator.sandbox import _layers, run_python
job = json.loads(sys.stdin.read())
job["caller"] = os.getpid()
result = run_python(job.pop("code"), stdin=json.dumps(job), audit_hook=False, timeout_s=10)
print(json.dumps({"layers": repr(_layers()), **dataclasses.asdict(result)}))
'''


def ipc_keys() -> set[int]:
    """The keys of the SysV IPC objects in this IPC namespace."""
    keys = set()
    for kind in ("shm", "msg", "sem"):
        for line in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
            keys.add(int(line.split()[0]))
    return keys


def message_queue_exists(name: str) -> bool:
    """Whether the POSIX message queue /`name` exists in this IPC namespace (if so, it is removed)."""
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    mqd = rt.mq_open(f"/{name}".encode(), os.O_RDONLY, 0, None)
    if mqd >= 0:
        rt.mq_close(mqd)
        rt.mq_unlink(f"/{name}".encode())
        return True
    return False


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            if text.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                found.append(int(name))
        except OSError:
            pass
    return found


@pytest.fixture
def hostile_job(tmp_path, monkeypatch):
    """What HOSTILE attacks: yields (job, check) where check(result) asserts that nothing got through."""
    monkeypatch.setenv("MARSI_SECRET", SECRET)  # in the caller's environment, which the program must not read
    visible = Path(tempfile.mkdtemp(prefix=".sentinel-", dir=REPO))  # outside the hidden directories
    visible.chmod(0o1777)  # world-writable: only the read-only mount stops the write
    (visible / "private.txt").write_text(SECRET)
    (visible / "private.txt").chmod(0o600)
    (tmp_path / "private.txt").write_text(SECRET)
    listener, abstract = sockets.socket(), sockets.socket(sockets.AF_UNIX)
    listener.bind(("127.0.0.1", 0))
    abstract_name = f"\0marsi-test-{os.getpid()}-{random.randrange(1 << 30)}"
    abstract.bind(abstract_name)
    for s in (listener, abstract):
        s.listen()
        s.setblocking(False)
    key = random.randrange(0x6D000000, 0x6DFF0000)
    name = f"marsi-escape-{key}"
    job = {"caller": os.getpid(), "key": key, "name": name, "port": listener.getsockname()[1],
           "abstract": abstract_name, "secrets": [str(visible / "private.txt"), str(tmp_path / "private.txt")],
           "outside": [str(visible), "/dev"]}

    def check(result: dict) -> None:
        assert result["ok"] and result["seconds"] < 10, result
        report = json.loads(result["stdout"])
        outcomes = report["outcomes"]
        assert SECRET not in result["stdout"] + result["stderr"], outcomes
        for what, outcome in outcomes.items():
            if what.startswith(("write", "mkdir", "signal", "tcp", "unix")):
                assert outcome.startswith("failed"), (what, outcome)
        assert all(i >= 0 for i in outcomes["ipc"]), outcomes["ipc"]  # the objects existed inside the run
        assert not {key + i for i in range(5)} & ipc_keys() and not message_queue_exists(name)
        assert processes_mentioning(report["scratch"]) == []  # the daemon did not outlive the run
        for where in job["outside"]:
            assert not [p for p in Path(where).iterdir() if p.name.startswith(name)]
        for s in (listener, abstract):
            with pytest.raises(BlockingIOError):
                s.accept()

    try:
        yield job, check
    finally:
        listener.close()
        abstract.close()
        shutil.rmtree(visible, ignore_errors=True)
        for leftover in Path("/dev").glob(f"{name}*"):
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        for option, i in (("-M", 0), ("-M", 1), ("-M", 2), ("-Q", 3), ("-S", 4)):  # what a failed check left
            if key + i in ipc_keys():
                subprocess.run(["ipcrm", option, str(key + i)], check=False)
        message_queue_exists(name)  # and unlinks it


@pytest.mark.skipif(not OS_LAYERS, reason="needs the namespace and uid layers")
def test_the_os_layers_hold_without_the_audit_hook_as_root(hostile_job):
    job, check = hostile_job
    result = run_python(HOSTILE, stdin=json.dumps(job), audit_hook=False, timeout_s=10)
    check(dataclasses.asdict(result))


@pytest.mark.skipif(not user_namespaces_work(), reason="needs user namespaces to play a user who is not root")
def test_the_os_layers_hold_without_the_audit_hook_as_a_user(hostile_job):
    job, check = hostile_job
    job["secrets"] = job["secrets"][1:]  # a user's own files outside the hidden directories stay readable to it
    done = run_as(_HOSTILE_CALLER, uid=1000, env={"MARSI_SECRET": SECRET}, stdin=json.dumps({**job, "code": HOSTILE}))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert "'--user', '--map-root-user'" in result["layers"] and "'--ipc'" in result["layers"]
    check(result)


# ------------------------------------------------------------------------------------------ fail closed
# The caller, with MARSI_SECRET=hunter2 in its environment, runs a program that reads the caller's environment
# through /proc (the audit hook does not stop reading): refused, or, in weak mode, run, and the secret leaks.
_CAN_RUN = r'''
import os
from orchestrator.sandbox import SandboxUnavailable, run_python
from protocols.errors import UserError, one_line
steal = "import os\nprint('leaked' if b'hunter2' in open('/proc/%d/environ' % os.getppid(), 'rb').read() else 'safe')"
try:
    result = run_python(steal)
except SandboxUnavailable as exc:
    assert isinstance(exc, UserError) and one_line(exc) == str(exc)
    print("refused:", exc)
else:
    print(result.stdout.strip(), run_python(steal, allow_weak=True).stdout.strip())
'''


@pytest.mark.skipif(not user_namespaces_work(), reason="needs user namespaces to play a user who is not root")
def test_a_user_without_user_namespaces_is_refused_in_one_line():
    done = run_as(_CAN_RUN, uid=1000, no_namespaces=("user",), env={"MARSI_SECRET": "hunter2"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("refused: ") and done.stdout.count("\n") == 1, done.stdout
    message = done.stdout.removeprefix("refused: ").strip()
    assert_documented("sandbox_no_user_namespaces", f"marsi: error: {message}")
    assert "user namespaces are unavailable (exit code 1: unshare: unshare failed: No space left on device)" in message


@pytest.mark.skipif(not user_namespaces_work(), reason="needs user namespaces to play a root without them")
def test_root_without_an_ipc_namespace_is_refused():
    # root of a user namespace where no IPC namespace can be made, and where SANDBOX_UIDS are not mapped
    done = run_as(_CAN_RUN, uid=0, no_namespaces=("ipc",), env={"MARSI_SECRET": "hunter2"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    message = done.stdout.removeprefix("refused: ").strip()
    assert_documented("sandbox_root_without_namespaces", f"marsi: error: {message}")
    assert "namespaces are unavailable (exit code 1: unshare: unshare failed: No space left on device)" in message


@pytest.mark.skipif(not user_namespaces_work(), reason="needs user namespaces to play a user who is not root")
def test_weak_mode_is_explicit_and_warns_once():
    env = {"MARSI_SECRET": "hunter2", "MARSI_SANDBOX_WEAK": "1"}
    done = run_as(_CAN_RUN, uid=1000, no_namespaces=("user",), env=env)
    assert done.returncode == 0 and done.stdout == "leaked leaked\n", done  # what the refusal prevents
    warning = done.stderr.strip()
    assert done.stderr.count("\n") == 1, warning
    assert_documented("sandbox_weak", warning)
    assert "it can use the network" in warning and "leave a setsid child running" in warning
    for value in ("0", "true", ""):  # only MARSI_SANDBOX_WEAK=1 opts in
        assert run_as(_CAN_RUN, uid=1000, no_namespaces=("user",),
                      env={"MARSI_SANDBOX_WEAK": value}).stdout.startswith("refused: ")
