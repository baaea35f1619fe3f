"""`marsi` called in the test's own process (orchestrator.cli.main): what it printed and its exit code, as
tests/runs.py's `marsi` gives them for a subprocess, without a new Python importing torch, transformers and Ray.

For tests about what a command prints, writes and returns. What needs a fresh process (Ray's start-up, signals,
a process killed, what is imported) stays with tests/runs.py's `marsi`; each command keeps at least one test there."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess

from orchestrator.cli import main


@contextlib.contextmanager
def environment(variables: dict | None):
    """os.environ with `variables` set (a value of None removes it), restored afterwards."""
    saved = {k: os.environ.get(k) for k in variables or {}}
    try:
        for k, v in (variables or {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def marsi(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`marsi ARGS` in this process: returncode, stdout and stderr as a subprocess's would be (argparse's exit
    included); `env` sets variables for the call (None removes one). Ray is not for this: a command that would start
    or join a cluster runs with ray.enabled false here, or in a subprocess."""
    argv = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return subprocess.CompletedProcess(["marsi", *argv], code, out.getvalue(), err.getvalue())
