"""AgentTrainer on the real built-in tiny model: generate, update, save/load, and learning."""

import math
import threading
import time

import pytest
import torch

from agent_trainer import models
from agent_trainer.trainer import AgentTrainer
from protocols.config import AgentConfig, AlgorithmConfig
from protocols.messages import Experience, GenerateRequest, UpdateRequest
from tests.loops import say_the_letter_curve


def make_trainer(seed=0, *, lr=1e-3, beta=0.0, micro_batch_size=16, max_completion_length=4, **alg):
    agent = AgentConfig(model="builtin:tiny", micro_batch_size=micro_batch_size,
                        generation={"max_completion_length": max_completion_length}, optimizer={"lr": lr})
    return AgentTrainer("a", agent, AlgorithmConfig(beta=beta, **alg), seed=seed)


def experiences(result, advantages):
    return [Experience(prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, advantage=a,
                       old_per_token_logps=c.per_token_logps) for c, a in zip(result.completions, advantages)]


@pytest.fixture(scope="module")
def batch():
    trainer = make_trainer()
    result = trainer.generate(GenerateRequest(prompts=["Say a", "Say bb", "Say c", "Say dddd"] * 2, seed=1))
    return result, [1.0, -1.0, 0.5, -0.5, 0.3, 0.2, -0.1, -0.4]


def test_generate_returns_unpadded_completions_with_logps(batch):
    result, _ = batch
    eos = make_trainer().tokenizer.eos_token_id
    for c in result.completions:
        assert 1 <= len(c.completion_ids) <= 4 and len(c.per_token_logps) == len(c.completion_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in c.per_token_logps)
        assert (c.finish_reason == "stop") == (c.completion_ids[-1] == eos)
        assert eos not in c.completion_ids[:-1]


def test_generate_replays_with_the_same_seed():
    trainer = make_trainer()
    request = GenerateRequest(prompts=["Say a", "Say b"], seed=5)
    assert trainer.generate(request).completions == trainer.generate(request).completions


def test_generation_logps_match_training_forward(batch):
    result, advantages = batch
    trainer = make_trainer()
    recomputed = trainer.per_token_logps(experiences(result, advantages))
    for c, logps in zip(result.completions, recomputed):
        assert logps == pytest.approx(c.per_token_logps, abs=1e-4)


def test_long_prompt_is_cut_from_the_left():
    trainer = make_trainer()
    trainer.agent = trainer.agent.model_copy(update={"generation": trainer.agent.generation.model_copy(
        update={"max_prompt_length": 8})})
    ids, truncated = trainer.encode_prompt("0123456789abcdef")
    assert truncated and ids == trainer.encode_prompt("89abcdef")[0]


def test_one_update_changes_every_parameter_and_returns_finite_metrics(batch):
    result, advantages = batch
    trainer = make_trainer(beta=0.1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.update(UpdateRequest(experiences=experiences(result, advantages)))
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p.detach())]
    assert unchanged == []
    for field in ("loss", "grad_norm", "kl", "entropy", "clip_fraction", "lr"):
        assert math.isfinite(getattr(metrics, field)), field
    assert metrics.grad_norm > 0 and metrics.entropy > 0 and metrics.policy_version == 1
    assert metrics.num_tokens == sum(len(c.completion_ids) for c in result.completions)
    assert trainer.ref_model is not None and all(torch.equal(before[n], p) for n, p in
                                                 trainer.ref_model.named_parameters())


def test_micro_batches_accumulate_to_the_same_gradient(batch):
    result, advantages = batch
    grads = []
    for trainer in (whole := make_trainer(micro_batch_size=8), make_trainer(micro_batch_size=3)):
        # record the accumulated gradient where the optimizer would step
        trainer.optimizer.step = lambda t=trainer: grads.append([p.grad.clone() for p in t.model.parameters()])
        trainer.update(UpdateRequest(experiences=experiences(result, advantages)))
    for (name, _), g, h in zip(whole.model.named_parameters(), *grads):
        assert g.abs().max() > 0 and torch.allclose(g, h, atol=1e-7, rtol=1e-4), name


def test_several_iterations_use_the_clipped_ratio(batch):
    result, advantages = batch
    trainer = make_trainer(lr=5e-2, num_iterations=3, epsilon=0.05)
    metrics = trainer.update(UpdateRequest(experiences=experiences(result, advantages)))
    assert 0 < metrics.clip_fraction <= 1


def test_save_then_load_reproduces_logps_exactly(batch, tmp_path):
    result, advantages = batch
    exps = experiences(result, advantages)
    trainer = make_trainer(lr=1e-2)
    trainer.update(UpdateRequest(experiences=exps))
    info = trainer.save(tmp_path / "ckpt")
    fresh = make_trainer(seed=123, lr=1e-2)
    assert fresh.per_token_logps(exps) != trainer.per_token_logps(exps)
    assert fresh.load(info.path).policy_version == 1
    assert fresh.per_token_logps(exps) == trainer.per_token_logps(exps)
    assert fresh.parameters_digest() == trainer.parameters_digest()
    # the optimizer state came along: the next update is identical too
    trainer.update(UpdateRequest(experiences=exps))
    fresh.update(UpdateRequest(experiences=exps))
    assert fresh.parameters_digest() == trainer.parameters_digest()


def test_saved_weights_load_with_plain_transformers(batch, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = make_trainer()
    trainer.update(UpdateRequest(experiences=experiences(*batch)))
    trainer.save(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert torch.equal(model.model.embed_tokens.weight, trainer.model.model.embed_tokens.weight)


def test_micro_batches_hold_neighbours_in_length_so_they_pad_less():
    from agent_trainer.trainer import by_length

    lengths = [(1, 9), (30, 2), (2, 8), (29, 3), (3, 7), (28, 1)]
    exps = [Experience(prompt_ids=[5] * p, completion_ids=[6] * c, advantage=0.0) for p, c in lengths]

    def padded_cells(rows, size=2):
        chunks = [rows[i:i + size] for i in range(0, len(rows), size)]
        return sum(len(ch) * (max(len(e.prompt_ids) for e in ch) + max(len(e.completion_ids) for e in ch))
                   for ch in chunks)

    ordered = by_length(exps)
    assert sorted(map(id, ordered)) == sorted(map(id, exps))
    assert padded_cells(ordered) <= 158 < padded_cells(exps) == 222


def test_a_checkpoint_before_any_update_names_the_model_and_restores_exactly(batch, tmp_path):
    """No update yet: the checkpoint holds the update count, optimizer and RNG state, and names the model
    instead of copying its weights; loading it into a trainer that has trained since brings back the model's
    weights, and the next update from there equals a fresh trainer's."""
    exps = experiences(*batch)
    trainer = make_trainer(lr=1e-2)
    initial = trainer.parameters_digest()
    trainer.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["source.json", "trainer_state.pt"]
    assert (tmp_path / "ckpt" / "trainer_state.pt").stat().st_size < 100_000
    trainer.update(UpdateRequest(experiences=exps))
    assert trainer.parameters_digest() != initial
    assert trainer.load(tmp_path / "ckpt").policy_version == 0
    assert trainer.parameters_digest() == initial and trainer.per_token_logps(exps) == make_trainer().per_token_logps(exps)
    fresh = make_trainer(lr=1e-2)
    trainer.update(UpdateRequest(experiences=exps))
    fresh.update(UpdateRequest(experiences=exps))
    assert trainer.parameters_digest() == fresh.parameters_digest() and trainer.policy_version == fresh.policy_version == 1


def test_plain_loop_learns_to_say_the_named_letter():
    """Group of 8 completions per prompt, group-relative advantages: mean reward rises from near 0 to > 0.7."""
    torch.set_num_threads(1)
    trainer = make_trainer(max_completion_length=2)
    curve = say_the_letter_curve(trainer.generate, trainer.update, 100)
    assert sum(curve[:10]) / 10 < 0.2 and sum(curve[-10:]) / 10 > 0.7


def test_trainer_processes_give_freed_tensors_back_to_the_system():
    """A block freed after glibc raised its mapping threshold stays in the heap (the process keeps it);
    `return_freed_memory`, called in every trainer process, gives it back."""
    import os
    import subprocess
    import sys

    code = """if 1:
        import os, sys
        if sys.argv[1] == "on":
            from agent_trainer.heap import return_freed_memory
            assert return_freed_memory()
        import torch
        def rss_mb():
            status = dict(line.split(":", 1) for line in open(f"/proc/{os.getpid()}/status").read().splitlines())
            return int(status["VmRSS"].split()[0]) // 1024
        block = torch.ones(4 * 2**20); del block  # one freed 16 MB block: glibc raises its threshold past it
        base = rss_mb()
        blocks = [torch.ones(4 * 2**20) for _ in range(16)]  # 256 MB, as an update's activations
        above = torch.ones(1024)  # allocated after them, so the heap cannot shrink from the top
        del blocks
        print(rss_mb() - base)
    """
    kept = {mode: int(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout) for mode in ("off", "on")}
    assert kept["on"] < 16 and kept["off"] >= kept["on"] + 16, kept


def test_a_builtin_built_by_several_at_once_is_built_once_and_leaves_no_temporary_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("MARSI_CACHE", str(tmp_path))
    killed = tmp_path / "builtin" / ".toy-v1-x1y2z3"  # what a builder killed mid-build leaves
    (killed / "half").mkdir(parents=True)
    builds = []

    def build(out):
        builds.append(out)
        time.sleep(0.3)  # long enough for every other builder to arrive meanwhile
        (out / "config.json").write_text("{}")

    threads = [threading.Thread(target=models._materialise, args=("toy-v1", build)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert sorted(p.name for p in (tmp_path / "builtin").iterdir()) == [".toy-v1.lock", "toy-v1"]

    def broken(out):
        (out / "part").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        models._materialise("other-v1", broken)
    assert sorted(p.name for p in (tmp_path / "builtin").iterdir()) == [".other-v1.lock", ".toy-v1.lock", "toy-v1"]
