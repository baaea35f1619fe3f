"""The weight channel between a learner and its engine apart: a gloo group of two, here two threads of this process
(each side's calls block as they would in its own process)."""

from __future__ import annotations

import datetime
import json
import os
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from agent_trainer.weight_channel import ChannelRefused, WeightChannel, buckets, unique

pytestmark = pytest.mark.fast


def tiny_model(seed: int):
    """A two-layer Llama whose output layer is its embedding (tied)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def _pair(timeout_s: float = 30.0, local: bool = False) -> tuple[WeightChannel, WeightChannel]:
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    sides = {}

    def join(rank):
        joined = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, 2, is_master=False,
                                                        timeout=datetime.timedelta(seconds=30))
        sides[rank] = WeightChannel(joined, rank, device=torch.device("cpu"), timeout_s=timeout_s, agent="alice",
                                    local=local)

    _both(join, (0,), (1,))
    sides[0].master = store  # the master store lives as long as the channel
    return sides[0], sides[1]


def _both(fn, first: tuple, second: tuple) -> dict:
    """`fn(*first)` and `fn(*second)` at once, each in a thread: what each returned, or the exception it raised."""
    out = {}

    def run(key, args):
        try:
            out[key] = fn(*args)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[key] = exc

    threads = [threading.Thread(target=run, args=(k, a)) for k, a in ((0, first), (1, second))]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    return out


def _transfer(learner, engine, sent: dict, received: dict, version: int, holds: int, owner=None) -> dict:
    return _both(lambda side, *args: side.send(*args) if side is learner else side.receive(*args),
                 (learner, sent, version, holds), (engine, received, version, owner))


def _same(target, source) -> bool:
    return all(torch.equal(target.state_dict()[n], t) for n, t in source.state_dict().items())


def _local_transfer_warning(match: str):
    """Version 0 of a tiny model over a channel on one node, which warns `match`."""
    source, target = tiny_model(seed=1), tiny_model(seed=2)
    learner, engine = _pair(local=True)
    with pytest.warns(UserWarning, match=match):
        out = _transfer(learner, engine, source.state_dict(), target.state_dict(), 0, 0, target)
    return learner, engine, source, target, out


def test_a_model_arrives_bit_for_bit_in_place_with_a_tied_embedding_sent_once():
    source, target = tiny_model(seed=1), tiny_model(seed=2)
    sent, received = source.state_dict(), target.state_dict()
    live = {name: tensor.data_ptr() for name, tensor in received.items()}
    learner, engine = _pair()
    out = _transfer(learner, engine, sent, received, 3, 3)
    assert out[1] is None and isinstance(out[0], int)
    after = target.state_dict()
    assert all(torch.equal(after[n], sent[n]) for n in sent)
    assert {n: t.data_ptr() for n, t in after.items()} == live  # into the engine's own tensors
    tied = [n for n in sent if n.endswith("lm_head.weight")]
    assert tied and out[0] == sum(t.numel() * t.element_size() for _, t in unique(sent))  # once, not twice
    assert out[0] < sum(t.numel() * t.element_size() for t in sent.values())


def test_a_bfloat16_learner_fills_a_float32_engine_and_buckets_hold_one_dtype_up_to_their_size():
    sent = {"big": torch.randn(64, 64).bfloat16(), "a": torch.randn(3).bfloat16(), "b": torch.randn(5),
            "c": torch.randn(2)}
    received = {name: torch.zeros(t.shape) for name, t in sent.items()}
    learner, engine = _pair()
    out = _transfer(learner, engine, sent, received, 0, 0)
    assert out == {0: 64 * 64 * 2 + 3 * 2 + 7 * 4, 1: None}
    assert all(torch.equal(received[n], sent[n].float()) for n in sent)
    f32, b16 = torch.float32, torch.bfloat16
    assert buckets([(8192, b16), (6, b16), (20, f32), (8, f32)], bucket_bytes=8192) == [[0], [1], [2, 3]]
    assert buckets([(4, f32), (4, f32), (4, f32)], bucket_bytes=8) == [[0, 1], [2]]


@pytest.mark.parametrize("case", ["version", "layout"])
def test_a_refused_transfer_raises_on_both_sides_and_leaves_the_engine_as_it_was(case):
    sent = {"w": torch.ones(4, 4), "b": torch.ones(4)}
    received = {"w": torch.zeros(4, 4), "b": torch.zeros(4 if case == "version" else 5)}
    learner, engine = _pair()
    out = _transfer(learner, engine, sent, received, 7, 6 if case == "version" else 7)
    assert isinstance(out[0], ChannelRefused) and isinstance(out[1], ChannelRefused)
    reason = out[0] if case == "version" else out[1]
    assert "agent 'alice'" in str(reason)
    assert ("holds policy version 6, not the 7 asked for" if case == "version"
            else "must load the same model") in str(reason)
    assert all(not t.any() for t in received.values())
    out = _transfer(learner, engine, sent, {"w": received["w"], "b": torch.zeros(4)}, 7, 7)  # the channel still works
    assert out[1] is None and received["w"].eq(1).all()


def test_a_side_left_alone_fails_at_the_channels_timeout_instead_of_waiting_for_ever():
    learner, _ = _pair(timeout_s=1.0)
    with pytest.raises(RuntimeError, match="(?i)timed out|timeout"):
        learner.send({"w": torch.ones(2)}, 0, 0)


def test_on_one_node_the_engines_weights_become_shared_memory_that_the_learner_writes_each_version_into():
    source, target = tiny_model(seed=1), tiny_model(seed=2).to(torch.bfloat16)
    learner, engine = _pair(local=True)
    ids = torch.tensor([[1, 5, 9, 3]])
    for version in (0, 1):
        if version:
            with torch.no_grad():  # the learner's next version
                for p in source.parameters():
                    p.add_(0.01)
        out = _transfer(learner, engine, source.state_dict(), target.state_dict(), version, version, target)
        assert out[1] is None
        assert out[0] == sum(t.numel() * 2 for _, t in unique(target.state_dict()))  # bf16 bytes, the tie once
        if version == 0:
            segment = engine.segment
            at = {n: p.data_ptr() for n, p in target.named_parameters()}
            assert not (Path("/dev/shm") / segment.memory.name).exists()  # nothing named is left to leak
        assert {n: p.data_ptr() for n, p in target.named_parameters()} == at  # the same memory each version
        assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()  # still tied
        assert all(torch.equal(target.state_dict()[n], t.to(torch.bfloat16)) for n, t in source.state_dict().items())
        with torch.no_grad():
            assert torch.equal(target(ids).logits, source.to(torch.bfloat16)(ids).logits)
        source.float()
    base = segment.memory.buf
    assert all(0 <= p.data_ptr() - torch.frombuffer(base, dtype=torch.uint8).data_ptr() < len(base)
               for p in target.parameters())  # every weight lives in the segment


def test_without_the_module_the_engine_takes_the_broadcast_even_on_one_node():
    sent, received = {"w": torch.ones(3, 3)}, {"w": torch.zeros(3, 3)}
    learner, engine = _pair(local=True)
    assert _transfer(learner, engine, sent, received, 0, 0) == {0: 36, 1: None}
    assert engine.segment is None and received["w"].eq(1).all()


def test_where_shared_memory_has_no_room_the_engine_takes_the_broadcast_and_says_so(monkeypatch):
    import errno

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    learner, engine, source, target, out = _local_transfer_warning(
        r"agent 'alice': its rollout engine takes its weights by broadcast, not in shared memory \(no room for .* "
        r"bytes of shared memory")
    assert out[1] is None and engine.segment is None and not engine.local
    assert _same(target, source)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"marsi-weights-{os.getpid()}-")]


def test_a_learner_that_cannot_write_into_the_shared_memory_broadcasts_into_it_instead(monkeypatch):
    from agent_trainer import weight_channel

    def unmappable(layout):
        raise FileNotFoundError(f"no segment {layout['name']}")

    monkeypatch.setattr(weight_channel, "LearnerViews", unmappable)
    learner, engine, source, target, out = _local_transfer_warning(
        r"agent 'alice': its learner sends its weights by broadcast: it cannot write into its engine's shared memory "
        r"\(FileNotFoundError: no segment ")
    assert out[1] is None and not learner.local and not engine.local
    base = torch.frombuffer(engine.segment.memory.buf, dtype=torch.uint8).data_ptr()
    assert all(0 <= p.data_ptr() - base < engine.segment.memory.size for p in target.parameters())  # adopted
    assert _same(target, source)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    out = _transfer(learner, engine, source.state_dict(), target.state_dict(), 1, 1, target)  # broadcast again
    assert out[1] is None and _same(target, source)


def test_an_engine_that_cannot_publish_its_layout_frees_the_segment_and_takes_the_broadcast(monkeypatch):
    from agent_trainer import weight_channel

    def unwritable(layout):
        raise OSError("the store went away")

    monkeypatch.setattr(weight_channel, "json", types.SimpleNamespace(dumps=unwritable, loads=json.loads))
    learner, engine, source, target, out = _local_transfer_warning(
        r"agent 'alice': its rollout engine takes its weights by broadcast, not in shared memory \(OSError: the "
        r"store went away\)")
    assert out[1] is None and engine.segment is None and _same(target, source)
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"marsi-weights-{os.getpid()}-")]


def test_a_dtype_the_channel_does_not_carry_is_refused_on_both_sides():
    learner, engine = _pair()
    out = _transfer(learner, engine, {"w": torch.ones(2, dtype=torch.complex64)}, {"w": torch.zeros(2)}, 0, 0)
    assert isinstance(out[0], ChannelRefused) and isinstance(out[1], ChannelRefused)
    assert "its learner's tensor w is torch.complex64, which the weight channel does not carry" in str(out[0])


def test_two_processes_gpu_check_on_cpu():
    """The GPU check of the channel (benchmarks/gpu_channel.py) run with gloo on CPU: two spawned processes of their
    own (not two threads) form the channel; a transfer makes the engine's weights the learner's, bit for bit, and a
    version the learner does not hold is refused on both sides."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_channel.py"
    done = subprocess.run([sys.executable, str(script), "--cpu", "--layers", "2", "--repeats", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("[E] ok   ") == 2 and "gpu_channel: all checks passed" in done.stdout


def test_a_learner_and_engine_sharing_one_gpu_get_no_nccl_group():
    """NCCL refuses two ranks on one device: a learner and its engine apart holding fractions of one GPU on one node
    take the object store (the start says why); separate GPUs, or separate nodes, may form the group."""
    from agent_trainer.engines_apart import shared_gpu

    def info(node, *gpus):
        return {"node": node, "gpu_ids": list(gpus)}

    assert shared_gpu(info("n1", "0"), info("n1", "0")) == "0"
    assert shared_gpu(info("n1", "0", "1"), info("n1", "1")) == "1"
    assert shared_gpu(info("n1", "0"), info("n1", "1")) is None
    assert shared_gpu(info("n1", "0"), info("n2", "0")) is None  # GPU 0 of two nodes
    assert shared_gpu(info("n1"), info("n1")) is None  # CPU: gloo
