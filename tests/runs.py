"""Running `marsi` in a subprocess and reading what a run wrote: shared by the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from orchestrator.steplog import computed

MARSI = [sys.executable, "-m", "orchestrator.cli"]


def marsi(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([*MARSI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def write(tmp_path: Path, raw: dict, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def rows(run_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def without_times(metrics: list[dict]) -> list[dict]:
    return [computed(m) for m in metrics]


def sigkill_a_run_after(config_path: Path, run_dir: Path, steps: int = 2) -> None:
    """`marsi run` in a child process, SIGKILLed once its metrics hold `steps` rows."""
    proc = subprocess.Popen([*MARSI, "run", str(config_path), "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (run_dir / "metrics.jsonl").exists() or len(rows(run_dir)) < steps:
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def killed_and_resumed(config_path: Path, run_dir: Path, steps: int) -> list[dict]:
    """The metrics (times left out) of a `steps`-step run SIGKILLed after 2 of them and resumed with `marsi resume`."""
    sigkill_a_run_after(config_path, run_dir)
    assert len(rows(run_dir)) < steps
    out = subprocess.run([*MARSI, "resume", str(run_dir)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return without_times(rows(run_dir))


def run_killing(coord, pid: int, at_step: int) -> list[dict]:
    """`coord.run()` while another thread SIGKILLs process `pid` once the run has done `at_step` steps."""
    def kill_mid_run():
        while coord.state.step < at_step:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_mid_run)
    killer.start()
    try:
        return coord.run()
    finally:
        killer.join()


def uninterrupted_rows(config, run_dir) -> list[dict]:
    """The metrics of a whole run of `config` (a RunConfig) in `run_dir`, times left out: what an interrupted,
    restarted or resumed run must end with."""
    from orchestrator.coordinator import Coordinator

    with Coordinator(config, run_dir) as coord:
        coord.run()
    return without_times(rows(run_dir))


def claim_at_once(logs) -> dict:
    """Each RunLog in `logs` claims its (new) run in its own thread, all released at one instant: log -> "claimed", or
    the message it was refused with."""
    barrier, outcome = threading.Barrier(len(logs)), {}

    def claim(log):
        barrier.wait()
        try:
            log.claim(resume=False)
            outcome[log] = "claimed"
        except Exception as exc:
            outcome[log] = str(exc)

    threads = [threading.Thread(target=claim, args=(log,)) for log in logs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome
