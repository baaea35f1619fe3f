"""Run a Python script of the tests as another kind of host user, for real: in a user namespace of its
own, as uid 1000 without capabilities (a user who is not root) or as its root, with some of the per-
namespace limits (/proc/sys/user/max_*_namespaces) set to 0 there, so that the sandbox's probe meets
a host where those namespaces cannot be created. Nothing changes outside that user namespace."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def user_namespaces_work() -> bool:
    """Can this test process make the user namespaces these helpers need?"""
    try:
        return subprocess.run(["unshare", "--user", "--map-root-user", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


def run_as(script: str, *, uid: int, no_namespaces: tuple[str, ...] = (), env: dict[str, str] | None = None,
           stdin: str = "", timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run `script` with this interpreter, in the repository, as `uid` (0: root; else no capabilities) of a
    new user namespace where the namespace kinds `no_namespaces` ("user", "ipc", ...) cannot be created."""
    limits = "".join(f"echo 0 > /proc/sys/user/max_{kind}_namespaces; " for kind in no_namespaces)
    drop = "" if uid == 0 else "setpriv --inh-caps=-all --ambient-caps=-all --bounding-set=-all -- "
    command = ["unshare", "--user", f"--map-user={uid}", f"--map-group={uid}", "--keep-caps",
               "/bin/sh", "-euc", f'{limits}exec {drop}"$@"', "sh", sys.executable, "-c", script]
    kept = ("PATH", "HOME", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")
    base = {key: os.environ[key] for key in kept if key in os.environ}
    return subprocess.run(command, cwd=REPO, env={**base, **(env or {})}, input=stdin, capture_output=True,
                          text=True, timeout=timeout_s)
