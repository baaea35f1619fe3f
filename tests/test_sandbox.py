"""The sandbox against hostile programs: real subprocesses, no mocks. Each hostile run must fail with a clear
reason, within its time limit, leaving the test process alive and nothing running or written behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from orchestrator import sandbox
from orchestrator.sandbox import SANDBOX_UIDS, SandboxResult, run_python, sandbox_available

REPO = Path(__file__).resolve().parents[1]
LAYERS = sandbox._layers()
OS_LAYERS = bool(LAYERS.unshare) and LAYERS.drop_uid


def sandbox_processes() -> list[int]:
    """Processes (zombies included) running as any sandbox uid."""
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:  # exited meanwhile
            continue
        if int(status.split("\nUid:\t")[1].split()[0]) in SANDBOX_UIDS:
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
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = run_python(bomb, timeout_s=2, max_processes=16)
    assert_contained(result, "timeout", 5)
    deadline = time.monotonic() + 2  # without a pid namespace, the host's init reaps the killed children
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


@pytest.mark.skipif(not (LAYERS.unshare or LAYERS.drop_uid), reason="needs the pid namespace or the uid layer")
def test_daemonized_child_does_not_outlive_the_run():
    program = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    result = run_python(program, timeout_s=5)
    assert result.ok and result.stdout == "done\n" and result.seconds < 3
    assert sandbox_processes() == []


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
    assert_contained(run_python(code), "Permission denied", 10)
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


@pytest.mark.parametrize("target", ["os.getppid()", str(os.getpid())])
def test_killing_the_caller_fails(target):
    result = run_python(f"import os, signal\nos.kill({target}, signal.SIGKILL)")
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
