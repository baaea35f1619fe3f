"""`marsi` on several argument lists, one after another, in one fresh Python process: for a table of cases that
each need a process that has started no Ray, without a new Python (importing torch, transformers and Ray) per case.

    python -m tests.one_process CASES.json RESULTS.json

CASES.json holds [{"argv": [...], "env": {NAME: value or null}}, ...]. Each case runs `orchestrator.cli.main(argv)`
with its variables set (null: removed) and file descriptors 1 and 2 captured, as a subprocess's output would be;
RESULTS.json gets, per case, {"returncode", "stdout", "stderr", "ray_initialized"} (Ray connected after the case).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def _captured(argv: list[str]) -> tuple[int, str, str]:
    from orchestrator.cli import main

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        return code, out.read().decode(), err.read().decode()


def run_cases(cases: list[dict]) -> list[dict]:
    from tests.inproc import environment

    results = []
    for case in cases:
        with environment(case["env"]):
            code, out, err = _captured(case["argv"])
        ray = sys.modules.get("ray")
        results.append({"returncode": code, "stdout": out, "stderr": err,
                        "ray_initialized": bool(ray and ray.is_initialized())})
    return results


def marsi_cases(cases: list[dict], work: Path, env: dict | None = None, timeout: int = 600) -> list[dict]:
    """Run `cases` (see above) in one new process, whose own environment is this one's with `env` applied (None
    removes a variable); the results, in order."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "cases.json").write_text(json.dumps(cases))
    merged = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    done = subprocess.run([sys.executable, "-m", "tests.one_process", str(work / "cases.json"),
                           str(work / "results.json")], capture_output=True, text=True, env=merged, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return json.loads((work / "results.json").read_text())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    Path(sys.argv[2]).write_text(json.dumps(run_cases(json.loads(Path(sys.argv[1]).read_text()))))
