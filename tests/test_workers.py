"""Data-parallel agents: K workers sample and update as one worker does, survive a killed worker, and resume on any K."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from agent_trainer import workers
from agent_trainer.group import placement_problem
from agent_trainer.handle import TrainerFailure
from orchestrator.coordinator import Coordinator
from protocols.config import ConfigError, validate_config
from protocols.messages import UpdateRequest
from protocols.plan import plan_of
from tests.dp_workers import REQUEST, VARIANTS, die_in_a_collective, experiences, make_trainer, worker
from tests.envs import HERE, config
from tests.errors_doc import assert_documented, assert_quoted
from tests.runs import rows, without_times, run_killing, uninterrupted_rows, write

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_workers():
    """What one worker and two workers (processes joined by gloo) generate and train from the same batch."""
    torch.set_num_threads(1)
    single = make_trainer().generate(REQUEST).completions
    batch = experiences(single)
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, ports, batch, results)) for rank in range(2)]
    for p in procs:
        p.start()
    got = dict((rank, (completions, updates)) for rank, completions, updates in
               (results.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    return single, batch, got


def test_a_non_finite_loss_on_one_worker_skips_the_step_on_every_worker(two_workers):
    _, _, got = two_workers
    (params0, result0), (_, result1) = got[0][1][len(VARIANTS)], got[1][1][len(VARIANTS)]
    assert result0.skipped_steps == result1.skipped_steps == 1
    for name, p in make_trainer().model.named_parameters():  # worker 0's weights did not move
        assert (params0[name] == p.detach().numpy()).all(), name


def test_shares_are_contiguous_and_cover_every_row():
    assert [workers.share(7, r, 2) for r in range(2)] == [(0, 4), (4, 7)]
    assert [workers.share(2, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]


def test_two_workers_sample_what_one_worker_samples(two_workers):
    single, _, got = two_workers
    shares = got[0][0] + got[1][0]
    assert [c.completion_ids for c in shares] == [c.completion_ids for c in single]
    for mine, theirs in zip(shares, single):
        assert mine.per_token_logps == pytest.approx(theirs.per_token_logps, abs=1e-6)


@pytest.mark.parametrize("variant", VARIANTS, ids=["token", "sequence-2-passes", "token-micro-batches"])
def test_two_workers_update_to_the_parameters_of_one(two_workers, variant):
    _, batch, got = two_workers
    torch.set_num_threads(1)
    one = make_trainer(*variant)
    result = one.update(UpdateRequest(experiences=batch))
    i = VARIANTS.index(variant)
    (params0, result0), (params1, result1) = got[0][1][i], got[1][1][i]
    assert result.grad_norm > 0.05  # clipping is active: the workers clip by the global norm
    initial = dict(make_trainer().model.named_parameters())
    for name, p in one.model.named_parameters():
        assert not torch.equal(p.detach(), initial[name]), name  # the update moved it
        # the same sums in another order: rounding, amplified by Adam's per-element normalisation, within 1% of a step
        assert torch.allclose(torch.from_numpy(params0[name]), p.detach(), rtol=0, atol=1e-5), name
        assert (params0[name] == params1[name]).all(), name  # the workers stay identical
    for key in ("loss", "grad_norm", "kl", "entropy", "clip_fraction", "logp_mismatch", "logp_gap_max"):
        assert getattr(result0, key) == pytest.approx(getattr(result, key), rel=1e-5, abs=1e-7), key
    assert (result0.num_tokens, result0.num_sequences) == (result.num_tokens, result.num_sequences)
    untimed = {"seconds": 0.0, "sync_seconds": 0.0}
    assert result1.model_copy(update=untimed) == result0.model_copy(update=untimed)  # both report the whole batch


# ------------------------------------------------------------------------------------ through the coordinator
STEPS = 3


def raw_config(workers_a=1, ray=False, steps=STEPS, agents=("a", "b")):
    raw = config(agents, train={"steps": steps, "batch_size": 2, "num_generations": 3, "checkpoint_every": 1,
                        "keep_checkpoints": 5}, ray=ray)
    for agent in raw["agents"].values():
        agent["resources"] = {"num_cpus": 0.25}
    raw["agents"]["a"]["resources"]["num_workers"] = workers_a
    return raw


def assert_same_metrics(metrics, reference):
    """Row by row the same keys and values; floats to 1e-5, or 1e-6 near 0 (the workers sum gradients in another
    order, and a log-prob gap of 1e-7 is rounding)."""
    assert [sorted(m) for m in metrics] == [sorted(r) for r in reference]
    for m, r in zip(metrics, reference):
        for key, value in r.items():
            if isinstance(value, float):
                assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (m["step"], key)
            else:
                assert m[key] == value, (m["step"], key)


@pytest.fixture(scope="module")
def one_worker_each(tmp_path_factory):
    """Metrics of the reference run: agent 'a' alone (every process the Ray runs below start costs seconds), on one
    worker, in-process, STEPS + 2 steps."""
    return uninterrupted_rows(validate_config(raw_config(steps=STEPS + 2, agents=("a",))),
                              tmp_path_factory.mktemp("one-worker-each"))


def test_two_worker_agent_runs_as_one_survives_a_killed_worker_and_resumes_on_one(ray_cluster, tmp_path,
                                                                                   one_worker_each):
    with Coordinator(validate_config(raw_config(workers_a=2, ray=True, agents=("a",))), tmp_path) as coord:
        group = coord.pool.info()["a"]["workers"]
        assert len({w["pid"] for w in group}) == 2
        victim = group[1]["pid"]

        run_killing(coord, victim, at_step=1)
        assert coord.restarts == 1
        assert victim not in {w["pid"] for w in coord.pool.info()["a"]["workers"]}
        # a worker that dies while its peer waits in a collective: the peer's error is the death, not a bug
        with pytest.raises(TrainerFailure, match=r"agent 'a': update failed: worker 1 of 2: its process "
                                                 r"died") as failure:
            die_in_a_collective(coord.pool)
        assert failure.value.recoverable
        assert_quoted(str(failure.value))
    assert_same_metrics(without_times(rows(tmp_path)), one_worker_each[:STEPS])
    # the 2-worker run's checkpoint resumes on one worker (in-process) and continues as the reference does
    with Coordinator.resume(tmp_path, ["agents.a.resources.num_workers=1", "ray.enabled=false",
                                       f"train.steps={STEPS + 2}"]) as coord:
        coord.run()
    assert_same_metrics(without_times(rows(tmp_path)), one_worker_each)


def test_a_two_worker_agent_with_an_engine_of_its_own_runs_as_one(ray_cluster, tmp_path, one_worker_each):
    """`rollout.placement: separate` on a data-parallel agent: one engine process, fed by worker 0, samples every
    worker's rows (the workers hold no engine that samples); the run's metrics are the one-worker run's."""
    raw = raw_config(workers_a=2, ray=True, agents=("a",))
    raw["agents"]["a"]["rollout"] = {"placement": "separate"}  # the engine asks for a's per-worker resources, once
    config = validate_config(raw)
    with Coordinator(config, tmp_path) as coord:
        info = coord.pool.info()["a"]
        pids = {w["pid"] for w in info["workers"]}
        assert len(pids) == 2 and info["rollout_engine"]["pid"] not in pids
        coord.run()
    assert coord.plan.engine_resources["a"].num_workers == 1
    assert_same_metrics(without_times(rows(tmp_path)), one_worker_each[:STEPS])


_DIE_IN_A_COLLECTIVE = """
import gc, sys, time
from agent_trainer.handle import TrainerFailure
from orchestrator.coordinator import Coordinator
from protocols.config import validate_config
from tests.dp_workers import die_in_a_collective
from tests.test_workers import raw_config

raw = raw_config(workers_a=2, ray=True, agents=("a",))
with Coordinator(validate_config(raw)) as coord:
    try:
        die_in_a_collective(coord.pool)
    except TrainerFailure as failure:
        print(failure)
    gc.collect()  # the call's object refs go: Ray reports an error nobody took as it drops its ref
    time.sleep(5)
"""


def test_a_worker_dying_in_a_collective_fails_its_peer_quietly(join_ray_cluster):
    # as a user's driver runs it (Ray's log lines reach its stderr: it is a driver of its own, which joins the
    # session's cluster rather than start one)
    done = subprocess.run([sys.executable, "-c", _DIE_IN_A_COLLECTIVE], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, **join_ray_cluster})
    assert "agent 'a': update failed: worker 1 of 2: its process died" in done.stdout, done
    assert "Unhandled error" not in done.stderr and "Connection reset by peer" not in done.stderr, done.stderr


def _refused(raw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate_config(raw, source="run.yaml")
    return info.value


def test_config_refuses_workers_without_ray_and_placement_counts_every_worker(tmp_path, capsys, monkeypatch):
    from orchestrator.cli import main

    assert_documented("workers_without_ray", _refused(raw_config(workers_a=2)))
    raw = raw_config(workers_a=2, ray=True)
    raw["agents"]["a"]["rollout"] = {"engine": "vllm"}
    assert_documented("workers_with_vllm", _refused(raw))
    raw = raw_config(workers_a=2, ray=True)
    raw["agents"]["a"]["resources"]["num_gpus"] = 0.5
    assert_documented("workers_share_a_gpu", _refused(raw))
    raw = raw_config(workers_a=2, ray=True)
    raw["agents"]["a"]["adapter"] = {"rank": 4}
    assert_documented("workers_on_adapter_agent", _refused(raw))
    raw = raw_config(ray=True)
    for name in ("a", "b"):
        raw["agents"][name].pop("resources", None)
        raw["agents"][name].update(adapter={"rank": 4}, host="shared")
    raw["hosts"] = {"shared": {"resources": {"num_cpus": 0.5, "num_workers": 2}}}
    assert_documented("workers_on_shared_host", _refused(raw))
    raw = raw_config(ray=True)
    raw["eval"] = {"data": {"factory": f"{HERE / 'envs.py'}:held_out"}, "partners": {"first": {"b": "initial"}},
                   "partner_resources": {"num_workers": 2}}
    assert_documented("partner_workers", _refused(raw))
    raw = raw_config(workers_a=4, ray=True)
    checked = validate_config(raw)
    assert placement_problem(checked, plan_of(checked), 1.0, 0.0, "the Ray cluster") == (
        "agents ask for 1.25 CPUs in all (a: 0.25 x 4 workers, b: 0.25) but the Ray cluster has 1; lower "
        "agents.NAME.resources.num_cpus (fractions such as 0.5 share a core) or num_workers, or give the cluster more")
    raw = raw_config(workers_a=2, ray=True)  # as marsi validate says it in a process not connected to Ray
    monkeypatch.setattr("orchestrator.preflight.ray_is_up", lambda: False)  # another test's Ray may be up here
    raw["agents"]["a"]["resources"]["num_cpus"] = 1
    raw["agents"]["b"]["resources"]["num_cpus"] = 0.5
    raw["ray"]["num_cpus"] = 2
    capsys.readouterr()
    code = main(["validate", str(write(tmp_path, raw))])
    assert_documented("workers_beyond_cluster", capsys.readouterr().err, exit=code, tmp=tmp_path)
