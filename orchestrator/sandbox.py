"""Run untrusted Python (code that agents wrote) in a contained subprocess: `run_python`.

Environments must never `exec` agent code in the coordinator or a trainer; they call `run_python` and
read the `SandboxResult`. Each run gets a fresh scratch directory (its working directory and $HOME,
removed afterwards), a minimal environment (nothing of the caller's leaks) and these layers:

OS layers, which are what really contain (each holds with the audit hook bypassed; tests run hostile
programs with it left out):
  uid         As root, each run executes as its own uid, leased from SANDBOX_UIDS for that run alone
              (no supplementary groups, no capabilities, no_new_privs). It cannot read the caller's
              private files, cannot signal the caller, and RLIMIT_NPROC holds (root ignores it). Needs
              root, setpriv (util-linux) and pidfds (Linux >= 5.3).
  namespaces  `unshare`: a network namespace with only a loopback that is down (no network at all); a
              pid namespace (the program sees only its own processes, and when its first process dies
              the kernel kills the rest); an IPC namespace (SysV shared memory, semaphores and message
              queues, and POSIX message queues, die with the run); a mount namespace where /tmp,
              /var/tmp, /run, /dev/shm, /root and /home are empty tmpfs (so unix sockets there, e.g.
              Ray's, are out of reach too), the interpreter's prefix is mounted back, every mount (/,
              and any other file system: a project on its own disk, /dev) is read-only and nosuid, and
              only the scratch directory is writable (nosuid, nodev, noexec). Needs util-linux and
              root, or unprivileged user namespaces: then the program is root of its own user namespace,
              without capabilities, in place of the uid layer; it has the caller's uid on the host, so
              it can read what the caller can read outside the hidden directories.
  rlimits     CPU seconds (a little over timeout_s), address space (memory_mb), processes
              (max_processes), file size (max_file_mb), 64 open files, no core dumps.
  kill        The run has its own session. When it ends (exit, timeout, output limit) its process
              group and every process of its uid get SIGKILL; if the caller dies, so does the run
              (parent-death signal). Output is read as it comes and cut at max_output_bytes.
Python layer, for clear errors only: it is bypassable by native code (a C extension or exploit) and by
Python tricks (dir_fd-relative paths, symlink races, importlib), so it is never the only guard:
  audit hook  Installed (sys.addaudithook) before the program runs, it refuses writing outside the
              scratch directory, sockets, starting programs (subprocess, os.system, exec*, spawn*,
              importing _posixsubprocess anew), signalling other processes, importing ctypes or
              subinterpreters, and the gc introspection that could reach the hook. It raises
              PermissionError("sandbox: forbidden: ..."), which becomes the result's reason. fork is
              allowed: the process limit and the kill layer contain it. `run_python(audit_hook=False)`
              leaves it out, for tests of the OS layers only.

Fail closed (Linux only). The layers are probed once per process, best combination first, with a tiny
run that must answer from this very interpreter (an unprivileged uid may not reach an interpreter
installed under /root, e.g. pyenv; the mount namespace mounts it back). The documented containment is
the namespaces and setpriv, plus the uid layer when marsi is root. Where the probe finds less,
`run_python` (and `ensure_contained`, which environments call when they are made) raises
SandboxUnavailable, one line naming what is missing and the fix, e.g. "user namespaces are unavailable
(...) and marsi is not root". The user may opt in to weaker containment with MARSI_SANDBOX_WEAK=1 in
the environment (or `run_python(allow_weak=True)`, which coop_coding's `allow_weak_sandbox` passes):
then a warning on stderr, once per process, says which promises do not hold. Without namespaces, the
network and the file system are guarded only by the audit hook and file permissions, and IPC objects
outlive the run. Without the uid layer, RLIMIT_NPROC counts all of the caller's processes, or, as root,
does not apply at all. With neither the uid layer nor the pid namespace, only the audit hook keeps the
program from reading the caller's environment and signalling its processes, and a child that leaves
the process group (setsid) survives the run. `sandbox_available()` names what is active.

Never contained: reading world-readable files outside the hidden directories, using CPU and memory
bandwidth the caller might want, memory held in SysV shared memory while the run lasts (it is freed
when the run ends), and learning timing or host details from /proc and /sys. A caller killed with
SIGKILL leaves its scratch directory behind (its sandboxed processes die with it).
"""

from __future__ import annotations

import functools
import math
import os
import pwd
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from protocols.errors import UserError

SANDBOX_UIDS = range(61000, 65000)  # not tied to accounts: uids that /etc/passwd names are skipped
WEAK_VAR = "MARSI_SANDBOX_WEAK"  # =1: run model code even where the documented containment is unavailable
_PYTHON = os.path.realpath(sys.executable)
_PREFIX = os.path.realpath(sys.base_prefix)  # the stdlib, mounted back read-only inside the namespace
_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # the program ran to completion with exit code 0 within limits
    reason: str  # "" when ok, else one short line: "timeout after 2.0s", "memory limit", "output limit", ...
    stdout: str  # captured, truncated to the output limit
    stderr: str
    returncode: int | None  # None when the sandbox killed the run (timeout, output limit)
    seconds: float


@dataclass(frozen=True)
class _Layers:
    unshare: tuple[str, ...]  # the unshare command line that creates the namespaces; () for none
    setpriv: str | None  # util-linux setpriv: no_new_privs, capability drop, parent-death signal
    drop_uid: bool  # run as a leased uid from SANDBOX_UIDS (needs root and setpriv)
    missing: tuple[tuple[str, str], ...] = ()  # what the documented containment needs and these lack, and the fix


# Runs as root in the new mount namespace: hide the world-writable and home directories under empty
# tmpfs, mount the scratch directory and the Python prefix back (staged on /dev/shm while the others
# are covered), make every mount that can still be reached read-only and nosuid (/ and any other file
# system: a project on its own mount, /dev, ...; the mounts under the covered directories are out of
# reach, autofs holds no files), the scratch directory writable again, then exec the rest of the command
# line. mountinfo writes " " in a path as \040; printf %b decodes \0040.
_MOUNT_SCRIPT = r"""
scratch=$1 prefix=$2; shift 2
tmpfs() { mount -t tmpfs -o size=64k,mode=755,nosuid,nodev sandbox "$1"; }
tmpfs /dev/shm
mkdir /dev/shm/scratch /dev/shm/prefix
mount --bind "$scratch" /dev/shm/scratch
mount --bind "$prefix" /dev/shm/prefix
for dir in /tmp /var/tmp /run /root /home; do
    if [ -d "$dir" ] && [ ! -L "$dir" ]; then tmpfs "$dir"; fi
done
mkdir -p "$scratch" "$prefix"
mount --move /dev/shm/scratch "$scratch"
mount --move /dev/shm/prefix "$prefix"
awk '$6 !~ /^ro(,|$)/ && !/ - autofs / { print $5 }' /proc/self/mountinfo | while IFS= read -r dir; do
    case $dir in *\\*) dir=$(printf '%b' "$(printf '%s' "$dir" | sed 's/\\\([0-7][0-7][0-7]\)/\\0\1/g')") ;; esac
    mount -o remount,bind,ro,nosuid "$dir" 2>/dev/null && continue
    if mountpoint -q "$dir"; then echo "sandbox: cannot make $dir read-only" >&2; exit 1; fi  # else covered
done
mount -o remount,bind,rw,nosuid,nodev,noexec "$scratch"
cd "$scratch"
exec "$@"
"""

# Runs as the sandboxed user, as `python -I -S -B -c _BOOTSTRAP SCRATCH HOOK RLIMIT_X:SOFT:HARD ...`: sets
# the rlimits, installs the audit hook (unless HOOK is "no-hook"), then runs SCRATCH/main.py as __main__.
_BOOTSTRAP = r"""
import _posixsubprocess, os, resource, sys

def _confine(scratch, hook_wanted, limits):
    for spec in limits:
        name, soft, hard = spec.split(":")
        resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
    if hook_wanted == "no-hook":  # run_python(audit_hook=False): tests of the OS layers alone
        return
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    path_args = {"os.mkdir": (0,), "os.rmdir": (0,), "os.remove": (0,), "os.rename": (0, 1),
                 "os.link": (0, 1), "os.symlink": (1,), "os.chmod": (0,), "os.chown": (0,),
                 "os.truncate": (0,), "os.utime": (0,), "os.setxattr": (0,), "os.removexattr": (0,)}
    programs = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile"}
    modules = {"ctypes", "_ctypes", "_xxsubinterpreters", "_xxinterpchannels", "_testcapi", "_testinternalcapi"}
    introspection = {"gc.get_objects", "gc.get_referrers", "gc.get_referents"}
    realpath, fsdecode, fspath, getpid = os.path.realpath, os.fsdecode, os.fspath, os.getpid

    def writable(path):
        if isinstance(path, int):  # an open descriptor: its opening was checked
            return True
        path = fsdecode(fspath(path))
        if path in ("/dev/null", "/dev/stdout", "/dev/stderr"):
            return True
        path = realpath(path)
        return path == scratch or path.startswith(scratch + "/")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or flags & write_flags
            if not writing or writable(path):
                return
            what = f"writing outside the scratch directory ({path})"
        elif event in path_args:
            outside = [args[i] for i in path_args[event] if not writable(args[i])]
            if not outside:
                return
            what = f"writing outside the scratch directory ({outside[0]})"
        elif event.startswith("socket."):
            what = f"network ({event})"
        elif event in programs:
            what = f"starting programs ({event})"
        elif event == "os.kill" and args[0] != getpid() or event == "os.killpg":
            what = f"signalling other processes ({event})"
        elif event == "import" and args[0] == "_posixsubprocess":  # imported anew, unpatched
            what = "starting programs (import _posixsubprocess)"
        elif event == "import" and args[0].partition(".")[0] in modules or event.startswith("ctypes."):
            what = f"native code ({args[0] if event == 'import' else event})"
        elif event in introspection:
            what = f"introspection ({event})"
        else:
            return
        raise PermissionError(f"sandbox: forbidden: {what}")

    def fork_exec(*args):  # subprocess calls it after its audit event; called directly it raises none
        raise PermissionError("sandbox: forbidden: starting programs (_posixsubprocess.fork_exec)")

    _posixsubprocess.fork_exec = fork_exec
    sys.addaudithook(hook)

def _start():
    scratch, hook_wanted, *limits = sys.argv[1:]
    path = os.path.join(scratch, "main.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    _confine(scratch, hook_wanted, limits)
    main = sys.modules["__main__"].__dict__
    main["__file__"], sys.argv = path, [path]
    for name in ("_posixsubprocess", "os", "resource", "sys", "_confine", "_start"):
        del main[name]  # the program gets a clean __main__
    return compile(source, path, "exec"), main

exec(*_start())
"""

_PROBE = "import json, sys\nprint(sys.version)\n"
_WARNED: list[str] = []  # the weak-mode warning, once this process printed it


class SandboxUnavailable(UserError):
    """This host cannot give the documented containment, and weak mode was not allowed."""


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, max_output_bytes: int = 64_000,
               max_processes: int = 16, max_file_mb: int = 8, stdin: str = "", allow_weak: bool = False,
               audit_hook: bool = True) -> SandboxResult:
    """Run `code` as a Python program in the sandbox (see the module docstring) and report how it ended.

    Raises SandboxUnavailable when this host lacks a layer of the documented containment, unless
    `allow_weak` or MARSI_SANDBOX_WEAK=1 (then it warns once per process). `audit_hook=False` leaves the
    audit hook out, for tests that the OS layers hold on their own; it needs the full containment."""
    layers = _layers()
    ensure_contained(allow_weak=allow_weak)
    if not audit_hook and layers.missing:
        raise ValueError("sandbox: audit_hook=False is for testing the OS layers, and this host lacks some")
    return _run(layers, code, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                max_processes=max_processes, max_file_mb=max_file_mb, stdin=stdin, audit_hook=audit_hook)


def ensure_contained(*, allow_weak: bool = False) -> None:
    """Return when `run_python` gives the documented containment here. Otherwise raise SandboxUnavailable,
    naming what is missing and how to fix it, unless `allow_weak` or the environment variable
    MARSI_SANDBOX_WEAK=1 allows weaker containment: then print once per process, on stderr, what does
    not hold. Environments call it when they are made, so that a run stops before its first episode."""
    layers = _layers()
    if not layers.missing:
        return
    what = "; ".join(m for m, _ in layers.missing)
    allowed_by = "allow_weak=True" if allow_weak else f"{WEAK_VAR}=1" if os.environ.get(WEAK_VAR) == "1" else ""
    if not allowed_by:
        fixes = "; ".join(dict.fromkeys(fix for _, fix in layers.missing))
        raise SandboxUnavailable(f"sandbox: cannot contain model code: {what}. Fix: {fixes}; or set {WEAK_VAR}=1 "
                                 "to run model code with weaker containment (README: Sandbox)")
    warning = (f"marsi: WARNING: sandbox: model code runs with WEAKER containment than documented ({allowed_by}): "
               f"{what}; so {'; '.join(_weak_spots(layers))}")
    if not _WARNED:
        _WARNED.append(warning)
        print(warning, file=sys.stderr, flush=True)


def sandbox_available() -> str:
    """Which containment layers are active on this host, one line each (for docs and debugging)."""
    layers = _layers()
    if layers.drop_uid:
        uid = f"uid: each run as its own uid from {SANDBOX_UIDS.start}-{SANDBOX_UIDS.stop - 1}, no capabilities"
    elif layers.unshare and os.geteuid() != 0:
        uid = "uid: unavailable (not root); runs as root of its own user namespace, without capabilities"
    else:
        uid = "uid: unavailable (needs root, setpriv and pidfds); runs as the caller's user"
    if layers.unshare:
        ns = ("namespaces: network (none), pid, IPC, mount (private /tmp /var/tmp /run /dev/shm /root /home, "
              "every mount read-only, only the scratch directory writable)")
    else:
        ns = "namespaces: unavailable; network and files guarded only by the audit hook and file permissions"
    kill = "kill: session process group" + (", every process of the uid" if layers.drop_uid else "") + (
        ", parent-death signal" if layers.setpriv else "")
    verdict = "containment: as documented" if not layers.missing else (
        f"containment: WEAK, run_python refuses unless {WEAK_VAR}=1 ({'; '.join(m for m, _ in layers.missing)})")
    return "\n".join([uid, ns, "rlimits: cpu, address space, processes, file size, open files, core", kill,
                      "audit hook: files, network, programs, signals, native code (bypassable by native code)",
                      verdict])


# ---------------------------------------------------------------------------------------------- layers
@functools.cache
def _layers() -> _Layers:
    """The strongest combination of layers that runs the probe with this very interpreter, with what it lacks
    of the documented containment: namespaces (network, pid, IPC, mount) and setpriv; as root, the uid layer."""
    setpriv, unshare = shutil.which("setpriv"), shutil.which("unshare")
    root = os.geteuid() == 0
    namespaces = [(unshare, *([] if root else ["--user", "--map-root-user"]), "--net", "--pid", "--ipc", "--fork",
                   "--kill-child", "--mount-proc")] if unshare else []
    drop = [True] if root and setpriv and _pidfds_work() else []
    failures: list[tuple[_Layers, str]] = []
    for ns in [*namespaces, ()]:
        for drop_uid in [*drop, False]:
            layers = _Layers(unshare=ns, setpriv=setpriv, drop_uid=drop_uid)
            try:
                result = _run(layers, _PROBE, timeout_s=10.0, memory_mb=512, max_output_bytes=4096,
                              max_processes=16, max_file_mb=1, stdin="")
            except OSError as exc:  # e.g. chown to a uid that this (user namespace's) root cannot map
                failures.append((layers, f"{type(exc).__name__}: {exc}"))
                continue
            if result.ok and result.stdout == sys.version + "\n":
                return replace(layers, missing=_missing(layers, root=root, unshare=unshare, failures=failures))
            failures.append((layers, result.reason or _other_python(result.stdout, layers)))
    raise RuntimeError("sandbox: cannot run Python in any configuration:\n" +
                       "\n".join(f"{layers}: {reason}" for layers, reason in failures))


def _other_python(stdout: str, layers: _Layers) -> str:
    """Why a probe that ran answered with another version than this interpreter's. As a leased uid: that uid
    cannot read part of this Python (e.g. a pyenv Python under /root, whose libpython is then the system's)."""
    here = sys.version.split()[0]
    said = (f"{_PYTHON} ran as Python {stdout.split()[0]}, not {here} as here" if stdout.split() else
            f"{_PYTHON} printed no version (here it is {here})")
    if layers.drop_uid:
        return f"as a leased uid, {said}: that uid cannot read all of this Python's files, e.g. its libpython"
    return said


def _missing(layers: _Layers, *, root: bool, unshare: str | None,
             failures: list[tuple[_Layers, str]]) -> tuple[tuple[str, str], ...]:
    """(what is missing, how to get it) for each layer of the documented containment that `layers` lack;
    `failures` are the stronger combinations the probe tried first, with why each failed: a layer's reason
    is that of the combination that differs from `layers` in that layer alone."""
    missing = []
    if not unshare:
        missing.append(("util-linux unshare is not installed", "install util-linux"))
    elif not layers.unshare:
        why = next(reason for tried, reason in failures if tried.unshare and tried.drop_uid == layers.drop_uid)
        if root:
            missing.append((f"namespaces are unavailable ({why})",
                            "let root create namespaces (in a container: CAP_SYS_ADMIN and a seccomp profile that "
                            "allows unshare)"))
        else:
            missing.append((f"user namespaces are unavailable ({why}) and marsi is not root",
                            "enable unprivileged user namespaces (sysctl user.max_user_namespaces=10000, and where "
                            "they exist kernel.unprivileged_userns_clone=1 and "
                            "kernel.apparmor_restrict_unprivileged_userns=0) or run marsi as root"))
    if not layers.setpriv:
        missing.append(("util-linux setpriv is not installed", "install util-linux"))
    elif root and not layers.drop_uid:
        if not _pidfds_work():
            missing.append(("the uid layer is unavailable: pidfds need Linux 5.3 or newer", "use Linux 5.3 or newer"))
        else:
            why = next(reason for tried, reason in failures if tried.drop_uid and tried.unshare == layers.unshare)
            missing.append((f"the uid layer failed ({why})", f"let root switch to the uids {SANDBOX_UIDS.start}-"
                                                            f"{SANDBOX_UIDS.stop - 1} and let them read this Python"))
    return tuple(missing)


def _weak_spots(layers: _Layers) -> list[str]:
    """What model code can do under `layers` that the documented containment forbids."""
    spots = []
    if not layers.unshare:
        spots.append("it can use the network, this host's services included")
        spots.append("it reads and writes what its uid may, /tmp and home directories included")
        spots.append("SysV IPC objects and POSIX message queues it creates outlive the run")
    if not (layers.unshare or layers.drop_uid):
        spots.append("it runs as this user: it can read this user's processes' environments (/proc/PID/environ), "
                     "signal them, and leave a setsid child running after the run")
    if not layers.drop_uid and os.geteuid() == 0:
        spots.append("it runs as root: the process limit does not apply" +
                     ("" if layers.setpriv else ", and it keeps root's capabilities"))
    if not layers.setpriv:
        spots.append("no no_new_privs, and the run outlives a caller killed with SIGKILL until its timeout")
    return spots


def _pidfds_work() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):
        return False


@contextmanager
def _lease_uid() -> Iterator[int]:
    """A uid from SANDBOX_UIDS that no account uses and no other run on this host holds. The lease is an
    abstract unix socket named after the uid, which the kernel releases when it is closed or its holder dies."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as lease:
        for uid in random.sample(SANDBOX_UIDS, 64):
            with suppress(KeyError):
                pwd.getpwuid(uid)
                continue
            try:
                lease.bind(f"\0marsi-sandbox-uid-{uid}")
            except OSError:
                continue
            yield uid
            return
    raise RuntimeError(f"sandbox: no free uid in {SANDBOX_UIDS}")


def _command(layers: _Layers, scratch: str, uid: int | None, audit_hook: bool, rlimits: list[str]) -> list[str]:
    command = [_PYTHON, "-I", "-S", "-B", "-c", _BOOTSTRAP, scratch, "hook" if audit_hook else "no-hook", *rlimits]
    if layers.setpriv:
        as_uid = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
        caps = ["--bounding-set=-all"] if os.geteuid() == 0 or layers.unshare else []  # (namespace) root
        command = [layers.setpriv, *as_uid, "--nnp", *caps, "--pdeathsig=KILL", "--", *command]
    if layers.unshare:
        command = [*layers.unshare, "--", "/bin/sh", "-euc", _MOUNT_SCRIPT, "sandbox", scratch, _PREFIX, *command]
        if layers.setpriv:  # unshare dies with the caller, and its child with it (--kill-child)
            command = [layers.setpriv, "--pdeathsig=KILL", "--", *command]
    return command


# ------------------------------------------------------------------------------------------------- run
def _run(layers: _Layers, code: str, *, timeout_s: float, memory_mb: int, max_output_bytes: int,
         max_processes: int, max_file_mb: int, stdin: str, audit_hook: bool = True) -> SandboxResult:
    cpu_s = math.ceil(timeout_s) + 1
    rlimits = [f"RLIMIT_CPU:{cpu_s}:{cpu_s + 1}", f"RLIMIT_AS:{memory_mb << 20}:{memory_mb << 20}",
               f"RLIMIT_NPROC:{max_processes}:{max_processes}", f"RLIMIT_FSIZE:{max_file_mb << 20}:{max_file_mb << 20}",
               "RLIMIT_NOFILE:64:64", "RLIMIT_CORE:0:0"]
    with _lease_uid() if layers.drop_uid else nullcontext() as uid, tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        scratch = os.path.realpath(tempfile.mkdtemp(prefix="marsi-sandbox-"))
        try:
            with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            if uid is not None:
                _kill_uid(uid)  # leftovers of a caller that crashed while holding this uid
                os.chown(scratch, uid, uid)
            start = time.monotonic()
            command = _command(layers, scratch, uid, audit_hook, rlimits)
            proc = subprocess.Popen(command, cwd=scratch, start_new_session=True,
                                    env={"PATH": _PATH, "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch},
                                    stdin=stdin_file if stdin else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            killed = "interrupted"
            try:
                killed, out, err = _collect(proc, start + timeout_s, max_output_bytes,
                                            on_exit=functools.partial(_kill_rest, proc, uid, finished=True))
            finally:
                _kill_rest(proc, uid, finished=not killed)
            seconds = time.monotonic() - start
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if killed == "timeout":
        reason = f"timeout after {float(timeout_s)}s"
    elif killed:
        reason = killed
    else:
        reason = _explain(proc.returncode, stderr)
    return SandboxResult(ok=not reason, reason=reason, stdout=stdout, stderr=stderr,
                         returncode=None if killed else proc.returncode, seconds=seconds)


def _collect(proc: subprocess.Popen, deadline: float, limit: int,
             on_exit: Callable[[], None]) -> tuple[str, bytes, bytes]:
    """Read stdout and stderr until both close; stop early, returning "timeout" or "output limit" as the
    first item, at the deadline or when either passes `limit` bytes (then cut to `limit`)."""
    captured = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    killed = ""
    with selectors.DefaultSelector() as selector:
        for stream in captured:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map() and not killed:
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "timeout"
                break
            for key, _ in selector.select(min(left, 0.1)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                captured[key.fileobj] += chunk
                if len(captured[key.fileobj]) > limit:
                    killed = "output limit"
            if proc.poll() is not None:
                on_exit()  # the program is done: children it left must not hold the pipes open
    return killed, bytes(captured[proc.stdout][:limit]), bytes(captured[proc.stderr][:limit])


def _kill_rest(proc: subprocess.Popen, uid: int | None, finished: bool) -> None:
    """SIGKILL everything the run started and reap the top process. A `finished` run first gets a moment
    to report its own exit status."""
    if finished:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(1)
    if uid is not None:
        _kill_uid(uid)  # wherever they went (setsid, another process group)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(1)  # unshare reaps its child, then exits
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the root-owned helpers, or everything when there is no uid
    proc.wait()


def _kill_uid(uid: int, patience_s: float = 5.0) -> None:
    """SIGKILL every live process of `uid` until none is left (new forks may race the first rounds)."""
    deadline = time.monotonic() + patience_s
    while (pids := _live_pids(uid)) and time.monotonic() < deadline:
        for pid in pids:
            with suppress(OSError):  # already gone
                pidfd = os.pidfd_open(pid)  # pins the process, so a reused pid is never signalled
                try:
                    if _live_pids(uid, [str(pid)]):
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                finally:
                    os.close(pidfd)
        time.sleep(0.005)


def _live_pids(uid: int, names: list[str] | None = None) -> list[int]:
    """Processes (not zombies) whose real uid is `uid`, among /proc `names` (default: all)."""
    pids = []
    for name in names if names is not None else os.listdir("/proc"):
        if name.isdigit():
            with suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{name}/status") as f:
                    status = f.read()
                state = status.split("\nState:\t", 1)[1][0]
                if int(status.split("\nUid:\t", 1)[1].split()[0]) == uid and state not in "ZX":
                    pids.append(int(name))
    return pids


def _explain(returncode: int, stderr: str) -> str:
    """The one-line reason for a run that was not killed by the sandbox; "" when it succeeded."""
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    if returncode == 0:
        return ""
    if "MemoryError" in last or "Cannot allocate memory" in last:
        return "memory limit"
    if last.startswith("PermissionError: sandbox: "):
        return last.removeprefix("PermissionError: sandbox: ")  # "forbidden: network (socket.connect)"
    if "File too large" in last:
        return "file size limit"
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else "?"
        return "cpu time limit" if name == "SIGXCPU" else f"killed by signal {-returncode} ({name})"
    return f"exit code {returncode}" + (f": {last}" if last else "")
