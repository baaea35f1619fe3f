"""`marsi` end to end, in subprocesses, with tiny settings."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.cli import build_parser, main
from orchestrator.steplog import computed
from protocols.config import ConfigError
from tests.envs import config

MARSI = [sys.executable, "-m", "orchestrator.cli"]
RAY_DEFAULTS = {"RAY_AUTH_MODE": None, "RAY_ADDRESS": None}  # Ray as a user gets it: token auth on by default


def marsi(*args, env=None, timeout=300):
    """`marsi ARGS` in a subprocess; `env` adds variables to this one's, and removes those given as None."""
    merged = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run([*MARSI, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=merged)


def write(tmp_path, raw, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def without_times(rows):
    return [computed(r) for r in rows]


def test_run_writes_a_complete_run_directory_and_resume_continues_it(tmp_path):
    cfg = write(tmp_path, config(ray=True, train={"steps": 2, "checkpoint_every": 1, "keep_checkpoints": 1}))
    out = marsi("run", cfg, "--run-dir", tmp_path / "run", env=RAY_DEFAULTS)
    assert out.returncode == 0, out.stderr
    assert "Token authentication" not in out.stderr and "WARNING" not in out.stderr, out.stderr  # Ray's start-up noise
    assert "reward/mean: first" in out.stdout
    assert "marsi: precision: a float32 (auto: builtin:tiny stays float32); b float32" in out.stdout  # from the actors
    run = tmp_path / "run"
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward/mean", "reward/std", "loss/a", "kl/b", "grad_norm/a", "tokens/b", "time/generate",
                "time/update", "time/coordinator", "time/step"):
        assert key in rows[0], key
    assert rows[0]["trained"] == ["a", "b"]
    transcript = json.loads((run / "transcripts.jsonl").read_text().splitlines()[0])
    assert transcript["turns"][0]["actions"][0]["prompt"].startswith("Say ")
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 2
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000002"]  # keep_checkpoints: 1
    ckpt = run / "checkpoints" / "step-000002"
    assert (ckpt / "agents" / "a" / "model" / "config.json").exists()
    state = json.loads((ckpt / "coordinator.json").read_text())
    assert state["step"] == 2 and state["data"] == {"epoch": 0, "index": 4} and "schedule_phase" not in state

    out = marsi("resume", run, "train.steps=3", env=RAY_DEFAULTS)
    assert out.returncode == 0, out.stderr
    assert "resuming" in out.stderr and [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert "Token authentication" not in out.stderr and "WARNING" not in out.stderr, out.stderr


def test_resume_matches_an_uninterrupted_run(tmp_path):
    """In this process (tests/inproc.py): the subprocess runs of run and resume are the test above."""
    from tests.inproc import marsi as here

    raw = config(train={"steps": 3, "checkpoint_every": 1})
    assert here("run", write(tmp_path, raw), "--run-dir", tmp_path / "whole").returncode == 0
    assert here("run", write(tmp_path, raw), "train.steps=1", "--run-dir", tmp_path / "cut").returncode == 0
    out = here("resume", tmp_path / "cut", "train.steps=3")
    assert out.returncode == 0, out.stderr
    assert without_times(metrics(tmp_path / "cut")) == without_times(metrics(tmp_path / "whole"))
    assert "; 3 steps (2 this time), " in out.stdout, out.stdout  # all the run's steps, and the resumed part's


def test_validate_prints_schedule_and_roles(tmp_path):
    raw = config(schedule={"kind": "alternate"}, roles={"r0": "a", "r1": "b"})
    raw["roles"]["rotation"] = "per_episode"
    raw["train"]["num_generations"] = 4  # two episodes per seating in each sample's group
    raw["agents"]["b"]["dtype"] = "float16"
    out = marsi("validate", write(tmp_path, raw), "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert ("a: float32 (auto: builtin:tiny stays float32); b: float16 (as configured)" in out.stdout
            and "precision on this machine, CPU " in out.stdout), out.stdout
    assert "step 1: trains a" in out.stdout and "step 2: trains b" in out.stdout
    assert "episode 1: turn 1: r0=a* r1=b*" in out.stdout and "episode 2: turn 1: r0=b* r1=a*" in out.stdout


def test_schema_is_json_schema():
    out = marsi("schema")
    schema = json.loads(out.stdout)
    assert {"agents", "environment", "roles", "schedule"} <= set(schema["properties"])


def test_plot_writes_pngs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10, "loss/a": 1 - s / 10})
                                               + "\n" for s in range(1, 5)))
    out = marsi("plot", run, run, "--out", tmp_path / "both", "--smoothing", "0.3")  # a run overlaid on itself
    assert out.returncode == 0, out.stderr
    for name in ("plot.png", "reward.png"):
        assert (tmp_path / "both" / name).read_bytes()[:4] == b"\x89PNG"
    out = marsi("plot", run, "--smoothing", "1.5")
    assert out.returncode == 2 and "give a weight in [0, 1)" in out.stderr


def test_bad_config_gives_one_line_and_exit_2(tmp_path):
    raw = config()
    raw["train"]["stepz"] = 3
    out = marsi("run", write(tmp_path, raw))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and "train.stepz: unknown key" in out.stderr and "Traceback" not in out.stderr


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_run_joins_a_separately_started_cluster(tmp_path):
    port = _free_port()
    ray_bin = Path(sys.executable).parent / "ray"
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    # Token auth is switched off on both sides: this is a loopback-only test cluster.
    ray_env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--temp-dir={temp_dir}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ray_env)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.time() + 60
        while not _accepts(port):  # a connect costs nothing; each `ray status` starts a Python
            assert time.time() < deadline and head.poll() is None, "ray head did not come up"
            time.sleep(0.2)
        while subprocess.run([str(ray_bin), "status", f"--address={address}"], capture_output=True,
                             env=ray_env).returncode:
            assert time.time() < deadline and head.poll() is None, "ray head did not come up"
            time.sleep(1)
        cfg = write(tmp_path, config(("a",), ray=True, train={"steps": 1}))  # one trainer to place is enough
        out = marsi("run", cfg, "--run-dir", tmp_path / "run", env={"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"})
        assert out.returncode == 0, out.stderr
        assert f"joined the Ray cluster at {address}" in out.stderr
        assert len(metrics(tmp_path / "run")) == 1
        # a custom resource no node has: one line, nothing before it, from run and validate alike (one after the
        # other in one new process, tests/one_process.py: each joins the cluster for the check and leaves it)
        from tests.one_process import marsi_cases

        raw = config(ray=True, train={"steps": 1})
        raw["agents"]["b"]["resources"]["custom"] = {"marsi_test": 1}
        commands = (["run", write(tmp_path, raw), "--run-dir", tmp_path / "refused"], ["validate", write(tmp_path, raw)])
        for out in marsi_cases([{"argv": list(map(str, c)), "env": {}} for c in commands], tmp_path / "cases",
                               env={"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"}):
            assert out["returncode"] == 2 and out["stdout"] == "" and not out["ray_initialized"], out["stdout"]
            assert out["stderr"] == ("marsi: error: agents.b.resources.custom 'marsi_test': no node of the Ray cluster "
                                     "has it (custom resources and GPU types here: none); start a node with it (ray "
                                     "start --resources=...) or change the setting\n")
        assert not (tmp_path / "refused").exists()
    finally:
        head.terminate()
        head.wait(timeout=90)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_overrides_may_follow_options(tmp_path):
    from tests.inproc import marsi as here

    out = here("validate", write(tmp_path, config(train={"steps": 5})), "--steps", "3", "train.steps=1")
    assert out.returncode == 0, out.stderr
    assert "step 1:" in out.stdout and "step 2:" not in out.stdout


def test_debug_shows_the_traceback_before_or_after_the_subcommand(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    for argv in (["--debug", "run", str(missing)], ["run", str(missing), "--debug"],
                 ["run", str(missing), "train.steps=1", "--debug"], ["validate", "--debug", str(missing)]):
        with pytest.raises(ConfigError, match="cannot read config"):
            main(argv)
    assert main(["run", str(missing)]) == 2
    assert capsys.readouterr().err == (f"marsi: error: {missing}: cannot read config (No such file or directory); "
                                       "check the path\n")
    out = marsi("plot", tmp_path, "--debug")  # and in a subprocess: the traceback is printed
    assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr
    assert "FileNotFoundError: " in out.stderr and "marsi: error" not in out.stderr


def test_every_argument_has_help():
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"plot", "resume", "run", "schema", "validate"} <= set(subcommands.choices)
    for name, sub in [("marsi", parser), *subcommands.choices.items()]:
        for action in sub._actions:
            assert action.help and action.help != argparse.SUPPRESS, f"{name} {action.dest}: no help text"
        assert any(a.dest == "debug" for a in sub._actions), f"{name}: no --debug"
    assert {a.dest for a in subcommands._choices_actions} == set(subcommands.choices)  # each subcommand has help


def test_quiet_ray_startup_drops_only_the_token_notice():
    from agent_trainer.actor import _RAY_AUTH_LOGGER, quiet_ray_startup

    quiet_ray_startup()
    quiet_ray_startup()  # twice adds one filter
    logger, seen = logging.getLogger(_RAY_AUTH_LOGGER), []
    assert len(logger.filters) == 1
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage()[:40])
    logger.addHandler(handler)  # Ray's loggers do not propagate to the root logger
    try:
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    finally:
        logger.removeHandler(handler)
    assert seen == ["Token authentication is disabled for thi"]


def test_export_writes_a_full_model_agents_weights_at_the_last_checkpoint_and_its_model_at_step_0(tmp_path):
    """A full-model agent's step-0 checkpoint names its model (source.json); export then writes that model.
    A later checkpoint holds the trained weights; export writes exactly those, with their tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_trainer.trainer import weights_digest
    from orchestrator.coordinator import Coordinator
    from protocols.config import validate_config

    from tests.envs import HERE

    raw = config(train={"steps": 2, "checkpoint_every": 2}, environment={"name": f"{HERE / 'envs.py'}:ByteScoreEnv"})
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        initial = coord.parameters_digests()["a"]
        coord.run()
        trained = coord.parameters_digests()["a"]
    assert initial != trained
    for checkpoint, expected in (("step-000000", initial), ("last", trained), ("step-2", trained)):
        out = tmp_path / checkpoint
        assert main(["export", str(tmp_path / "run"), "--agent", "a", "--out", str(out), "--checkpoint", checkpoint]) == 0
        assert weights_digest(dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())) == expected
        assert AutoTokenizer.from_pretrained(out).encode("Say a") == AutoTokenizer.from_pretrained(
            tmp_path / "run" / "checkpoints" / "step-000002" / "agents" / "a" / "model").encode("Say a")


def test_checkpoint_names_parse_and_format_in_one_place(tmp_path):
    """`step-000015` is written; `step-15` (any width) names the same checkpoint; anything else names none."""
    from agent_trainer import storage
    from orchestrator.runlog import CheckpointName, RunLog

    assert str(CheckpointName(15)) == "step-000015" and str(CheckpointName(1234567)) == "step-1234567"
    assert CheckpointName.parse("step-15") == CheckpointName.parse("step-000015") == CheckpointName(15)
    assert [CheckpointName.parse(n) for n in ("step-", "step-x1", "15", ".tmp-step-000015", "step--1")] == [None] * 5
    assert sorted(map(CheckpointName, (10, 9, 100))) == [CheckpointName(9), CheckpointName(10), CheckpointName(100)]
    log = RunLog(tmp_path)
    for step in (9, 10):
        storage.write_bytes(log.checkpoint_dir() / str(CheckpointName(step)) / "coordinator.json", b"{}")
    storage.make_dirs(log.checkpoint_dir() / "step-000011")  # no coordinator.json: incomplete, never named
    assert [c.name for c in log.checkpoints()] == ["step-000009", "step-000010"]
    assert log.find_checkpoint("step-10").name == "step-000010" and log.find_checkpoint("step-000009").name == "step-000009"
    assert log.find_checkpoint("step-11") is None and log.find_checkpoint("last") is None
