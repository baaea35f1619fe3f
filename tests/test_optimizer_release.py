"""Optimizer state released between an agent's scheduled updates (agent_trainer/optimizer_offload.py,
orchestrator/memory_plan.py): frozen agents hold none, a released state comes back bit for bit and the process's
memory falls, and a run's metrics and checkpoints are those of a run that never releases."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from agent_trainer.optimizer_offload import OptimizerOffload, wait_all
from agent_trainer.trainer import AgentTrainer
from orchestrator.coordinator import Coordinator
from protocols.config import AgentConfig, AlgorithmConfig, validate_config
from protocols.messages import Experience, GenerateRequest, UpdateRequest
from tests.envs import config
from tests.runs import MARSI, rows, without_times, write


def make_trainer(*, trainable=True):
    agent = AgentConfig(model="builtin:tiny", generation={"max_completion_length": 4}, optimizer={"lr": 1e-3})
    return AgentTrainer("a", agent, AlgorithmConfig(), seed=0, trainable=trainable)


def update_once(trainer, seed=1):
    result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 2, seed=seed))
    advantages = [1.0, -1.0, 0.5, -0.5]
    trainer.update(UpdateRequest(experiences=[Experience.from_completion(c, a)
                                              for c, a in zip(result.completions, advantages)]))


def state_tensors(optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}/{k}": v.clone() for i, s in optimizer.state_dict()["state"].items() for k, v in s.items()}


def pss_bytes() -> int:
    """This process's proportional set size."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Pss line in /proc/self/smaps_rollup")


def test_a_frozen_agent_holds_no_optimizer_state_and_no_gradients():
    trainer = make_trainer(trainable=False)
    assert trainer.optimizer is None and trainer.offload is None
    trainer.generate(GenerateRequest(prompts=["Say a"], seed=0))
    assert all(p.grad is None for p in trainer.model.parameters())
    with pytest.raises(ValueError, match="frozen"):
        trainer.update(UpdateRequest(experiences=[]))
    trainer.hold_optimizer(False)  # the plan's call is harmless on a frozen agent
    trainer.close()


def test_released_then_fetched_state_is_bit_identical_and_the_next_update_the_same():
    kept, released = make_trainer(), make_trainer()
    for trainer in (kept, released):
        update_once(trainer)
    before = state_tensors(released.optimizer)
    assert before and all(p.grad is None for p in released.model.parameters())  # gradients freed after an update
    released.hold_optimizer(False)
    released.offload.wait()
    assert released.offload.released and len(released.optimizer.state) == 0
    released.hold_optimizer(True)  # fetched in the background
    released.offload.resident()
    after = state_tensors(released.optimizer)
    assert after.keys() == before.keys()
    for key in before:
        assert after[key].dtype == before[key].dtype and torch.equal(after[key], before[key]), key
    released.hold_optimizer(False)
    for trainer in (kept, released):  # the second update fetches on its own (nothing prefetched)
        update_once(trainer, seed=2)
    assert kept.parameters_digest() == released.parameters_digest()
    for key, value in state_tensors(kept.optimizer).items():
        assert torch.equal(value, state_tensors(released.optimizer)[key]), key
    scratch = released.offload._file
    assert scratch is not None and os.fstat(scratch.fileno()).st_nlink == 0  # no name: it goes with the process
    released.close()
    assert scratch.closed
    kept.close()


def test_a_checkpoint_taken_while_released_holds_the_real_state(tmp_path):
    trainer = make_trainer()
    update_once(trainer)
    before = state_tensors(trainer.optimizer)
    trainer.hold_optimizer(False)
    trainer.save(tmp_path / "ckpt")
    trainer.offload.wait()
    assert trainer.offload.released  # released again after the checkpoint, its file still current
    saved = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=False)["optimizer"]["state"]
    for key, value in before.items():
        i, name = key.split("/")
        assert torch.equal(saved[int(i)][name], value), key
    restored = make_trainer()
    restored.load(tmp_path / "ckpt")
    assert restored.parameters_digest() == trainer.parameters_digest()
    for key, value in state_tensors(restored.optimizer).items():
        assert torch.equal(value, before[key]), key
    trainer.close()
    restored.close()


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux's /proc/PID/smaps_rollup")
def test_releasing_lowers_the_process_memory():
    """256 MiB of AdamW state (two moments of a 32M-parameter tensor): the process's PSS falls by most of it when
    released, and comes back when fetched."""
    parameter = torch.nn.Parameter(torch.zeros(32 << 20))
    optimizer = torch.optim.AdamW([parameter], lr=1e-3)
    parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    parameter.grad = None
    offload = OptimizerOffload(optimizer, device=torch.device("cpu"), label="memory-test")
    wait_all()  # an earlier test's release or fetch, run by the process's one offload thread, is not measured here
    resident = pss_bytes()
    offload.release()
    offload.wait()
    released = pss_bytes()
    offload.prefetch()
    offload.resident()
    fetched = pss_bytes()
    offload.close()
    state_bytes = 2 * parameter.numel() * 4
    assert resident - released > 0.8 * state_bytes, (resident, released)
    assert fetched - released > 0.8 * state_bytes, (released, fetched)
    assert float(optimizer.state[parameter]["exp_avg"][0]) == pytest.approx(0.1)


def round_robin_raw(offload: str, steps: int = 6, **train) -> dict:
    raw = config(("a", "b", "c"), schedule={"kind": "round_robin"}, train={"steps": steps, **train})
    for agent in raw["agents"].values():
        agent["optimizer"]["offload"] = offload
    return raw


def round_robin(offload: str, steps: int = 6, **train):
    return validate_config(round_robin_raw(offload, steps, **train))


def test_round_robin_metrics_are_the_same_with_the_state_released_or_kept(tmp_path):
    for offload in ("auto", "off"):
        with Coordinator(round_robin(offload), tmp_path / offload) as coord:
            coord.run()
            if offload == "auto":  # after the last step (a's turn next) b and c hold nothing
                released = {a: t.offload.released for a, t in coord.pool.trainers.items()}
                assert released == {"a": False, "b": True, "c": True}
    assert without_times(rows(tmp_path / "auto")) == without_times(rows(tmp_path / "off"))


def test_a_checkpoint_while_released_resumes_to_the_same_metrics(tmp_path):
    with Coordinator(round_robin("off"), tmp_path / "kept") as coord:
        coord.run()
    with Coordinator(round_robin("auto", checkpoint_every=2), tmp_path / "released") as coord:
        coord.run(until=4)  # the checkpoint after step 4: b's turn next, a and c released
        assert {a: t.offload.released for a, t in coord.pool.trainers.items()} == {"a": True, "b": False, "c": True}
    checkpoint = max((tmp_path / "released" / "checkpoints").iterdir())
    state = torch.load(checkpoint / "agents" / "a" / "trainer_state.pt", weights_only=False)
    assert state["optimizer"]["state"], "a released agent's checkpoint holds its optimizer state"
    with Coordinator.resume(tmp_path / "released") as coord:
        coord.run()
    assert without_times(rows(tmp_path / "released")) == without_times(rows(tmp_path / "kept"))


# `marsi run` whose NTH read of a released optimizer state from its scratch file names the agent in MARKER and
# hangs there, so that the test can kill the run in the middle of a fetch.
HANGING_FETCH = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from agent_trainer import optimizer_offload
    from orchestrator import cli

    read, calls = optimizer_offload.OptimizerOffload._read_file, []

    def hanging_read(self):
        calls.append(self.label)
        if len(calls) == {nth}:
            open({marker!r}, "w").write(self.label)
            time.sleep(600)
        return read(self)

    optimizer_offload.OptimizerOffload._read_file = hanging_read
    sys.argv[0] = "marsi"
    sys.exit(cli.main())
""")


@pytest.mark.parametrize("nth", [1, 2])  # a fetch for the checkpoint after step 2; a prefetch before an update
def test_a_run_killed_while_fetching_a_released_state_resumes_to_the_same_metrics(tmp_path, nth):
    with Coordinator(round_robin("off"), tmp_path / "kept") as coord:
        coord.run()
    marker, run_dir = tmp_path / "fetching", tmp_path / "released"
    script = tmp_path / "marsi_hanging_fetch.py"
    script.write_text(HANGING_FETCH.format(repo=str(Path(__file__).resolve().parent.parent), nth=nth,
                                           marker=str(marker)))
    cfg = write(tmp_path, round_robin_raw("auto", checkpoint_every=2))
    proc = subprocess.Popen([sys.executable, str(script), "run", str(cfg), "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no fetch within 240 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert marker.read_text() in {"a", "b", "c"} and 2 <= len(rows(run_dir)) < 6  # killed mid-run, mid-fetch
    out = subprocess.run([*MARSI, "resume", str(run_dir)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert without_times(rows(run_dir)) == without_times(rows(tmp_path / "kept"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_released_to_pinned_memory_and_fetched_to_the_gpu_bit_for_bit():
    device = torch.device("cuda", 0)
    parameter = torch.nn.Parameter(torch.randn(1 << 20, device=device))
    optimizer = torch.optim.AdamW([parameter], lr=1e-3, fused=True)
    parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    before = state_tensors(optimizer)
    offload = OptimizerOffload(optimizer, device=device, label="gpu-test")
    allocated = torch.cuda.memory_allocated(device)
    offload.release()
    offload.wait()
    assert torch.cuda.memory_allocated(device) <= allocated - 2 * parameter.numel() * 4
    offload.prefetch()
    offload.resident()
    for key, value in state_tensors(optimizer).items():
        assert value.device == before[key].device and torch.equal(value, before[key]), key
    offload.close()


def test_adapter_agents_of_one_host_release_their_own_state(tmp_path):
    """Each adapter agent's optimizer holds its adapter's state only, released on its own: a and b of one shared
    host take turns (c frozen), with the same metrics as with every state kept."""
    from tests.test_adapters import shared_host_config

    for offload in ("auto", "off"):
        raw = shared_host_config(train={"steps": 3})
        for agent in raw["agents"].values():
            agent["optimizer"]["offload"] = offload
        with Coordinator(validate_config(raw), tmp_path / offload) as coord:
            coord.run()
            trainers = coord.pool.trainers
            if offload == "auto":  # after step 3 (a's), b's turn next
                assert (trainers["a"].offload.released, trainers["b"].offload.released) == (True, False)
                assert trainers["c"].offload is None
    assert without_times(rows(tmp_path / "auto")) == without_times(rows(tmp_path / "off"))


def test_a_scratch_file_that_cannot_be_written_keeps_the_state_resident(monkeypatch, capsys):
    """A full disk under the temporary directory: the release is refused with one line on stderr, the state stays
    in memory as it was, updates go on as if nothing were released, and the next release is not tried."""
    import errno

    import agent_trainer.optimizer_offload as offload_module

    kept, full = make_trainer(), make_trainer()
    for trainer in (kept, full):
        update_once(trainer)
    before = state_tensors(full.optimizer)

    def no_space(file, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(offload_module, "_write_all", no_space)
    full.hold_optimizer(False)
    full.offload.wait()  # raises nothing: the run goes on
    assert not full.offload.released and "No space left" in full.offload.unwritable
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "agent 'a': its optimizer state stays in memory" in err and "offload: off" in err
    for key, value in state_tensors(full.optimizer).items():
        assert torch.equal(value, before[key]), key
    full.hold_optimizer(False)  # not tried again, not said again
    full.offload.wait()
    assert not full.offload.released and capsys.readouterr().err == ""
    for trainer in (kept, full):
        update_once(trainer, seed=2)
    assert kept.parameters_digest() == full.parameters_digest()
    kept.close()
    full.close()
