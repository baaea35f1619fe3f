"""TensorBoard and W&B carry what metrics.jsonl holds: every scalar of every row at its step, read back from the
event file and from W&B's offline run file; W&B's episode tables hold the saved transcripts, one row per action."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest

from orchestrator.coordinator import Coordinator
from orchestrator.loggers import EPISODE_COLUMNS, TensorBoardLogger, episode_rows, scalars
from orchestrator.runlog import read_jsonl
from protocols.config import validate_config
from tests.envs import HERE, config

needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="tensorboard is not installed (make setup installs it: the test extra)")
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="wandb is not installed (make setup installs it: the test extra)")


def tensorboard_scalars(log_dir: Path) -> dict[tuple[int, str], float]:
    """(step, tag) -> value of every scalar event under `log_dir`, as TensorBoard reads them (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    found = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert (event.step, tag) not in found, f"{tag} logged twice at step {event.step}"
            found[event.step, tag] = event.value
    return found


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the offline W&B run under RUN_DIR/wandb: its `run-ID.wandb` file is a LevelDB-format
    log (32 KiB blocks; records of a 7-byte header - crc32, length, type - and a fragment; after W&B's own 7-byte
    header) of `wandb_internal_pb2.Record` messages, which `wandb sync` uploads."""
    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data, block, pos, fragment, rows = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += block - pos % block
            continue
        fragment += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(fragment)
            fragment = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def expected_scalars(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, key) -> value of every scalar of metrics.jsonl (a step's training and evaluation rows together)."""
    expected = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        for key, value in scalars(row).items():
            assert (row["step"], key) not in expected
            expected[row["step"], key] = value
    return expected


@needs_tensorboard
@needs_wandb
def test_tensorboard_and_wandb_carry_every_scalar_of_metrics_jsonl_and_wandb_the_episodes(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # nothing reaches the network
    monkeypatch.setenv("WANDB_SILENT", "true")
    raw = config(train={"steps": 3, "transcripts_per_step": 2, "progress": False},
                 logging={"tensorboard": True, "wandb_project": "marsi-test"})
    raw["eval"] = {"data": {"factory": f"{HERE / 'envs.py'}:held_out"}, "every": 2, "transcripts": 2}
    run_dir = tmp_path / "run"
    with Coordinator(validate_config(raw), run_dir) as coord:
        coord.run()
    expected = expected_scalars(run_dir)
    steps = {step for step, _ in expected}
    assert steps == {0, 1, 2, 3} and (2, "eval/reward/mean") in expected and (2, "reward/mean") in expected

    # TensorBoard: exactly those, at their steps (float32 in the event file)
    board = tensorboard_scalars(run_dir / "tensorboard")
    assert board.keys() == expected.keys()
    for where, value in expected.items():
        assert math.isclose(board[where], value, rel_tol=1e-6, abs_tol=1e-6), where

    # W&B: every row logged with its `step`, values exact (JSON)
    history = wandb_history(run_dir)
    logged = {}
    for row in history:
        if any(key.endswith("episodes/_type") for key in row):
            continue  # an episode table's log (below)
        for key, value in row.items():
            if not key.startswith("_") and key != "step":
                assert (row["step"], key) not in logged, f"{key} logged twice at step {row['step']}"
                logged[row["step"], key] = value
    assert logged == expected

    # W&B's episode tables: the saved transcripts, one row per action, in order
    tables = sorted(run_dir.glob("wandb/offline-run-*/files/media/table/**/*.table.json"),
                    key=lambda p: int(p.name.split("_")[-2]))  # episodes_N_HASH: N is W&B's _step, in log order
    train_rows, eval_rows = [], []
    for path in tables:
        table = json.loads(path.read_text())
        assert table["columns"] == EPISODE_COLUMNS
        (eval_rows if path.parent.name == "eval" else train_rows).extend(table["data"])

    def saved(name):
        return [row for step, group in _by_step(read_jsonl(run_dir / name)) for row in episode_rows(step, group)]

    assert train_rows == saved("transcripts.jsonl") and len(train_rows) == 3 * 2 * 2  # 2 episodes a step, 2 actions
    assert eval_rows == saved("eval_transcripts.jsonl") and eval_rows
    first = dict(zip(EPISODE_COLUMNS, train_rows[0]))
    assert first["step"] == 1 and first["policy_version"] == 0 and isinstance(first["advantage"], float)


def _by_step(transcripts):
    steps = sorted({t["step"] for t in transcripts})
    return [(step, [t for t in transcripts if t["step"] == step]) for step in steps]


@needs_tensorboard
def test_a_resume_drops_the_replayed_steps_from_tensorboard(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    for step in (1, 2, 3):
        logger.log({"step": step, "reward/mean": float(step), "kind": "first run", "stopped": False})
    logger.truncate_after(1)  # a resume from the checkpoint of step 1 replays 2 and 3
    for step in (2, 3):
        logger.log({"step": step, "reward/mean": 10.0 * step, "stopped": step == 3})
    logger.close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == {
        (1, "reward/mean"): 1.0, (1, "stopped"): 0.0,
        (2, "reward/mean"): 20.0, (2, "stopped"): 0.0, (3, "reward/mean"): 30.0, (3, "stopped"): 1.0}
