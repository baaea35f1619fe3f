"""A checkpoint of an agent whose weights are still its model's names that model by the SHA-256 of its files:
a copy with other modification times (plain `cp`, a per-node download, an image) is the same model; other
bytes are refused in one line that names the checkpoint, the node, the path and what differs."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from agent_trainer import models, storage
from agent_trainer.trainer import AgentTrainer, ModelChanged
from protocols.config import AgentConfig, AlgorithmConfig
from protocols.messages import Location
from tests.errors_doc import assert_documented


def copy_model(dest):
    """A copy of builtin:tiny's files with fresh modification times (as `cp` without -p makes)."""
    source = models.resolve_model_path("builtin:tiny")
    shutil.copytree(source, dest, copy_function=shutil.copyfile)
    for f in dest.rglob("*"):
        os.utime(f, ns=(1_000_000_000, 1_000_000_000))
    return dest


def frozen_trainer(model):
    agent = AgentConfig(model=str(model), generation={"max_completion_length": 2})
    trainer = AgentTrainer("a", agent, AlgorithmConfig(), trainable=False)
    trainer.where = "node worker (10.0.0.2, id 5f3c2b1a9d0e)"
    return trainer


@pytest.fixture
def saved(tmp_path, monkeypatch):
    """A frozen agent's checkpoint in a store its trainer stages (an object store), and the model path."""
    monkeypatch.setenv("MARSI_CACHE", str(tmp_path / "cache"))  # digests cached here, not in the user's cache
    monkeypatch.setattr(storage, "on_disk", lambda loc: None)
    model = copy_model(tmp_path / "model")
    target = Location(f"file://{tmp_path}/store") / "step-000003" / "agents" / "a"
    stored = storage.save(frozen_trainer(model), target=target)
    assert list(stored.files) == ["source.json"]
    return model, target, stored.files


@pytest.mark.fast
def test_a_copy_with_other_times_is_the_same_model(saved):
    model, target, files = saved
    for f in model.rglob("*"):  # as if copied again to this node: same bytes, other times
        os.utime(f, ns=(2_000_000_000, 2_000_000_000))
    assert storage.load(frozen_trainer(model), source=target, files=files) is None


@pytest.mark.fast
def test_other_bytes_are_refused_naming_checkpoint_node_path_and_file(saved):
    model, target, files = saved
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other contents
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1_000_000_000, 1_000_000_000))  # and the same time: only the contents tell
    with pytest.raises(ModelChanged) as info:
        storage.load(frozen_trainer(model), source=target, files=files)
    assert_documented("model_changed_on_node", info.value, AGENT="a", NODE="node worker (10.0.0.2, id 5f3c2b1a9d0e)",
                      STORE=target.parent.parent.parent, **{"/models/m": model})


@pytest.mark.fast
def test_a_record_without_digests_tells_times_from_contents(saved, tmp_path):
    """A checkpoint of an older marsi recorded [size, mtime_ns] per file: equal times pass; other times are named
    as such, with the way to keep them."""
    model, target, files = saved
    marker = tmp_path / "store" / "step-000003" / "agents" / "a" / "source.json"
    record = json.loads(marker.read_text())
    record["fingerprint"] = {f: [e["size"], e["mtime_ns"]] for f, e in record["fingerprint"].items()}
    marker.write_text(json.dumps(record))
    files = {"source.json": storage.sha256(marker)}
    assert storage.load(frozen_trainer(model), source=target, files=files) is None
    os.utime(model / "config.json", ns=(3_000_000_000, 3_000_000_000))
    with pytest.raises(ModelChanged, match=r"only modification times differ \(config.json\), but this checkpoint was "
                                           r"written by an older marsi .* \(rsync -a, cp -p\)"):
        storage.load(frozen_trainer(model), source=target, files=files)


@pytest.mark.fast
def test_a_files_digest_is_computed_once_per_node(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSI_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x" * 1000)
    first = models.file_sha256(f)
    (entry,) = (tmp_path / "cache" / "digests").iterdir()
    entry.write_text("0" * 64)  # the cache answers: the file is not read again
    assert models.file_sha256(f) == "0" * 64 != first
    os.utime(f, ns=(5, 5))  # another time: another key, read again
    assert models.file_sha256(f) == first == storage.sha256(f)
