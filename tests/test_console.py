"""What a run prints: start-up phases with their times on stdout, progress as plain lines when not on a
terminal, and a closed pipe ending a command quietly."""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess

from orchestrator.console import PlainProgress, progress
from tests.envs import HERE, config
from tests.runs import MARSI, write


def test_plain_progress_writes_a_line_every_few_steps_and_at_the_last():
    out = io.StringIO()
    bar = PlainProgress(total=7, initial=0, every=3, stream=out)
    for step in range(1, 8):
        bar.set_postfix(reward=f"{step / 10:.3f}", training="a")
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [
        "marsi: step 3/7, reward 0.300, training a", "marsi: step 6/7, reward 0.600, training a",
        "marsi: step 7/7, reward 0.700, training a"]
    assert all(line.endswith(" s/step)") for line in lines) and "\r" not in out.getvalue()


def test_the_bar_is_tqdm_on_a_terminal_and_plain_lines_elsewhere():
    assert isinstance(progress(0, 10, True, terminal=False), PlainProgress)
    bar = progress(0, 10, True, terminal=True)
    assert type(bar).__name__ == "tqdm" and not bar.disable
    bar.close()
    assert progress(0, 10, False, terminal=False).disable  # train.progress false: nothing at all


def test_a_piped_run_says_each_start_up_phase_and_writes_no_bar_fragments(tmp_path):
    """In the test's process (tests/inproc.py), its stdout and stderr strings, not a terminal, as a pipe is not."""
    from tests.inproc import marsi as here

    raw = config(train={"steps": 4, "progress": True})
    raw["eval"] = {"data": {"factory": f"{HERE / 'envs.py'}:held_out"}}
    out = here("run", write(tmp_path, raw), "--run-dir", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stdout.splitlines() if line.startswith("marsi: ")]
    assert any(line.startswith("marsi: 2 trainer(s) up; model load a ") and line.endswith(" s)") for line in said), said
    assert any(line.startswith("marsi: evaluation at step 0: eval/reward/mean ") for line in said), said
    assert "\r" not in out.stderr and "it/s" not in out.stderr and "step/s" not in out.stderr
    steps = [line for line in out.stderr.splitlines() if line.startswith("marsi: step ")]
    assert [line.split(",")[0] for line in steps] == [f"marsi: step {n}/4" for n in range(1, 5)]


def test_a_closed_pipe_ends_quietly():
    child = subprocess.Popen([*MARSI, "schema"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child.stdout.close()  # the reader is gone before marsi writes (marsi schema | head, head already done)
    _, err = child.communicate(timeout=120)
    assert err == "" and child.returncode == 128 + signal.SIGPIPE


# ------------------------------------------------------------------------- notices that ask nothing
def test_the_numa_notice_vllms_cpp_code_prints_on_fd_2_is_dropped_and_every_other_line_passes(capfd):
    from agent_trainer.engine_vllm import _without_c_notices

    with _without_c_notices():
        os.write(2, b"before\n[W1201 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for memory allocation "
                    b"on the NUMA nodes (0). (function init_cpu_memory_env)\n")
        os.write(2, b"a line in two wri")
        os.write(2, b"tes\nno newline at the end")
    os.write(2, b"|after\n")
    assert capfd.readouterr().err == "before\na line in two writes\nno newline at the end|after\n"


def test_a_process_started_inside_the_filter_that_keeps_fd_2_open_does_not_hold_the_caller(capfd):
    """A child that inherits the pipe as its stderr keeps it open past the filter's end: the caller goes on within
    seconds and the child's lines still pass. The child waits for a line from the test: the caller going on is seen
    as the child still running, whatever the machine's load."""
    import subprocess
    import threading

    from agent_trainer.engine_vllm import _without_c_notices

    with _without_c_notices():
        child = subprocess.Popen(["sh", "-c", "read line; echo from-the-child >&2"], stdin=subprocess.PIPE)
        release = threading.Timer(120, child.stdin.close)  # were the caller held until the child ends: it ends then
        release.start()
        [pump] = [t for t in threading.enumerate() if t.name == "marsi-stderr-filter"]
    running = child.poll() is None
    release.cancel()
    child.stdin.close()
    child.wait()
    assert running  # the filter ended while the child, which holds the pipe open, still ran
    pump.join(timeout=120)  # the child's exit closes the pipe: its lines are passed on, then the thread ends
    assert not pump.is_alive() and "from-the-child" in capfd.readouterr().err


def test_vllms_triton_notice_is_filtered_on_its_logger_and_its_other_records_are_not(monkeypatch, caplog):
    from agent_trainer import engine_vllm

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_LOGGING_LEVEL",
                 "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK"):
        monkeypatch.delenv(name, raising=False)  # put back as they were after the test
    engine_vllm._configure_environment()
    logger = logging.getLogger(engine_vllm._TRITON_LOGGER)
    with caplog.at_level(logging.WARNING, logger=engine_vllm._TRITON_LOGGER):
        logger.warning("Triton is installed, but doesn't include CPU backend. Disabling Triton.")
        logger.warning("Triton is broken")
    assert [r.getMessage() for r in caplog.records] == ["Triton is broken"]


def test_ray_prints_a_trainers_lines_but_not_its_blank_ones(capsys):
    import functools

    from ray._private.ray_logging import WorkerStandardStreamDispatcher
    from ray._private.worker import print_to_stdstream

    from agent_trainer.actor import drop_blank_worker_lines

    def printed(wrap: bool, pid: int) -> list[str]:
        dispatcher = WorkerStandardStreamDispatcher()  # what ray.init sets up on the driver (log_to_driver)
        dispatcher.add_handler("ray_print_logs", functools.partial(print_to_stdstream, ignore_prefix=False))
        if wrap:
            drop_blank_worker_lines(dispatcher)
            drop_blank_worker_lines(dispatcher)  # wrapping twice changes nothing
        base = {"ip": "127.0.0.1", "pid": pid, "job": "01000000", "is_err": True, "actor_name": "_TrainerActor",
                "task_name": ""}
        text = "wrapped, loaded" if wrap else "loaded"  # not alike (Ray's dedup holds back lines alike but for numbers)
        dispatcher.emit({**base, "lines": ["", text, "   "]})
        dispatcher.emit({**base, "lines": ["", ""]})
        return capsys.readouterr().err.splitlines()

    assert len(printed(False, 4241)) == 5  # Ray's own printer: a prefix alone for each blank line
    [line] = printed(True, 4242)
    assert "(_TrainerActor pid=4242" in line and line.endswith(" wrapped, loaded")
