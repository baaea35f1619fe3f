"""Regression tests of the RL path: each names the defect it guards against."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
import torch

from agent_trainer import trainer as trainer_module
from agent_trainer.models import resolve_model_path
from agent_trainer.trainer import AgentTrainer
from orchestrator import rollout
from orchestrator.baselines import experiences_by_agent
from orchestrator.coordinator import Coordinator
from orchestrator.schedule import RoleAssignment
from protocols.config import AgentConfig, AlgorithmConfig, RolesConfig, validate_config
from protocols.messages import Completion, Experience, GenerateRequest, UpdateRequest
from tests.envs import config


def make_trainer(model="builtin:tiny", *, lr=1e-3, generation=None, trainable=True, dtype="float32", rollout=None,
                 **alg):
    agent = AgentConfig(model=model, dtype=dtype, optimizer={"lr": lr}, rollout=rollout or {},
                        generation={"max_completion_length": 4, **(generation or {})})
    return AgentTrainer("a", agent, AlgorithmConfig(**alg), seed=0, **({} if trainable else {"trainable": False}))


def experiences(completions, advantages):
    return [Experience.from_completion(c, a) for c, a in zip(completions, advantages)]


def tiny_variant(tmp_path, name, **changes):
    """A copy of builtin:tiny on disk whose config.json / generation_config.json carry `changes`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model_path("builtin:tiny")
    model = AutoModelForCausalLM.from_pretrained(src)
    generation = changes.pop("generation", {})
    for key, value in changes.items():
        setattr(model.config, key, value)
    for key, value in generation.items():
        setattr(model.generation_config, key, value)
    out = tmp_path / name
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)


# --------------------------------------------------------------------------------- 1: group keys
def scripted_generate(answer):
    """A generate function that answers every prompt with `answer(prompt)`: a fixed, known policy."""
    def generate(prompts, seed):
        return {agent: [Completion(text=answer(p), prompt_ids=[1], completion_ids=[2], per_token_logps=[-0.1],
                                   finish_reason="stop") for p in ps]
                for agent, ps in prompts.items()}
    return generate


def play_relay(assignment, rotation="none", num_generations=4, samples=2):
    from examples.demo.env import RelayEnv

    roles = RoleAssignment(RolesConfig(assignment=assignment, rotation=rotation))
    batch = [{"letter": "abcd"[i % 4], "speaker": "." * i + "abcd"[i % 4], "listener": "?."} for i in range(samples)]
    return rollout.play(RelayEnv, batch, num_generations, roles, scripted_generate(lambda p: p.replace(".", "")),
                        seed=0, first_episode=0)


def test_group_advantages_compare_like_with_like_by_default():
    # one agent in both seats, a perfect policy: every episode earns 1.0, so nothing is better than the mean
    episodes = play_relay({"speaker": "solo", "listener": "solo"})
    assert {e.total_reward() for e in episodes} == {1.0}
    advantages = [e.advantage for e in experiences_by_agent(episodes, AlgorithmConfig(), {})["solo"]]
    assert advantages == [0.0] * 16
    # discount < 1: the two turns' returns differ (0.5 + 0.9 * 0.5 vs 0.5) but every episode is identical
    advantages = [e.advantage for e in experiences_by_agent(episodes, AlgorithmConfig(discount=0.9), {})["solo"]]
    assert advantages == [0.0] * 16
    # the wide pool stays available by name, and then compares the two turns
    pooled = [e.advantage for e in experiences_by_agent(episodes, AlgorithmConfig(group_by="agent"), {})["solo"]]
    assert sorted(set(round(a, 3) for a in pooled)) == [-1.0, 1.0]


def test_group_advantages_do_not_compare_an_agents_roles_under_per_episode_rotation():
    # alice and bob swap seats every episode, both play perfectly: 1.0 every time, whoever sits where
    episodes = play_relay({"speaker": "alice", "listener": "bob"}, rotation="per_episode", samples=1)
    assert {e.total_reward() for e in episodes} == {1.0}
    for agent, exps in experiences_by_agent(episodes, AlgorithmConfig(), {}).items():
        assert [x.advantage for x in exps] == [0.0] * 4, agent


# ---------------------------------------------------------------------------------- 2: EMA baseline
class _Ep:
    """A one-turn episode stub with fixed per-role rewards (pure advantage maths)."""

    def __init__(self, seats, rewards):
        from protocols.env import Environment

        env = type("Env", (Environment,), {"reset": lambda *a, **k: {}, "step": lambda *a: None})()
        env.possible_agents, env.max_turns = list(seats), 1
        actions = [rollout.Action(role, agent, "p", Completion(text="x", prompt_ids=[1], completion_ids=[2],
                                                                per_token_logps=[-1.0], finish_reason="stop"))
                   for role, agent in seats.items()]
        self.episode = rollout.Episode(index=0, sample_index=0, env=env,
                                       turns=[rollout.Turn(actions, dict(rewards), {})])


def test_ema_baseline_ignores_episode_order_and_is_kept_per_agent_and_role():
    alg = AlgorithmConfig(baseline="ema", ema_decay=0.5)
    outcomes = [+1.0, -1.0, -1.0, +1.0]
    results = []
    for order in (outcomes, sorted(outcomes)):
        episodes = [_Ep({"X": "p"}, {"X": r}).episode for r in order]
        baselines = {}
        adv = [e.advantage for e in experiences_by_agent(episodes, alg, baselines)["p"]]
        results.append((sorted(zip(order, adv)), baselines))
    (first, b1), (second, b2) = results
    assert first == second == [(-1.0, -1.0), (-1.0, -1.0), (1.0, 1.0), (1.0, 1.0)]  # first batch: baseline 0
    assert b1 == b2
    # two agents rotating through one seat keep separate baselines
    baselines = {}
    experiences_by_agent([_Ep({"X": "a"}, {"X": 1.0}).episode, _Ep({"X": "b"}, {"X": -1.0}).episode], alg, baselines)
    assert baselines["a"]["X"]["1"] > 0 > baselines["b"]["X"]["1"]


def test_rloo_baseline_is_the_mean_of_the_other_returns_of_the_group_by_hand():
    # one group of four (same sample, agent, role, turn), returns 3, 1, 0, 0:
    # 3 - (1 + 0 + 0) / 3 = 8/3;  1 - (3 + 0 + 0) / 3 = 0;  0 - (3 + 1 + 0) / 3 = -4/3 (twice)
    episodes = [_Ep({"X": "p"}, {"X": r}).episode for r in (3.0, 1.0, 0.0, 0.0)]
    adv = [e.advantage for e in experiences_by_agent(episodes, AlgorithmConfig(baseline="rloo"), {})["p"]]
    assert adv == pytest.approx([8 / 3, 0.0, -4 / 3, -4 / 3])
    # never scaled by the group's std, and chosen per agent like the others
    own = AlgorithmConfig(scale_rewards=True, agents={"p": {"baseline": "rloo"}})
    assert [e.advantage for e in experiences_by_agent(episodes, own, {})["p"]] == pytest.approx(adv)
    # a group of one has no other return: 0
    alone = experiences_by_agent([_Ep({"X": "p"}, {"X": 5.0}).episode], AlgorithmConfig(baseline="rloo"), {})
    assert [e.advantage for e in alone["p"]] == [0.0]


def test_ema_baseline_is_kept_per_turn_so_a_discounted_turn_is_not_scored_against_the_last():
    """A perfect solver in SelfImproveEnv, discount 0.9: turn 1 returns 0.9 and turn 2 returns 1.0 in every
    episode. Group baselines give 0 to both; an EMA shared by the role's two turns settles at 0.95 and scores
    them -0.05 / +0.05 forever, an EMA per turn converges to 0 for both."""
    from examples.self_improve.env import SelfImproveEnv, make_dataset

    samples = list(make_dataset(8, seed=0))

    def perfect(prompts_by_agent, seed):
        answers = {s["question"]: s["answer"] for s in samples}
        return {agent: [Completion(text=str(answers[next(q for q in answers if q in p)]), prompt_ids=[1],
                                   completion_ids=[2], per_token_logps=[-1.0], finish_reason="stop") for p in prompts]
                for agent, prompts in prompts_by_agent.items()}

    alg = AlgorithmConfig(baseline="ema", discount=0.9)
    baselines = {}
    for batch in range(60):
        episodes = rollout.play(SelfImproveEnv, samples, 1, lambda e, t: {"solver": "solo"}, perfect,
                                seed=batch, first_episode=batch * len(samples))
        advantages = [e.advantage for e in experiences_by_agent(episodes, alg, baselines)["solo"]]
    assert max(abs(a) for a in advantages) < 1e-6
    assert baselines["solo"]["solver"] == pytest.approx({"1": 0.9, "2": 1.0})


def test_ema_baselines_saved_per_role_are_read_per_turn():
    from orchestrator.advantages import saved_baselines

    assert saved_baselines({"a": {"X": 0.5, "O": {"1": 0.2}}}, 2) == {"a": {"X": {"1": 0.5, "2": 0.5}, "O": {"1": 0.2}}}


def test_zero_variance_share_counts_each_agents_groups_whose_returns_are_all_equal():
    from orchestrator.advantages import zero_variance_shares

    episodes = []
    for sample, rewards in enumerate([(1.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.5, 0.0)]):
        for reward in rewards:
            episode = _Ep({"X": "a", "O": "b"}, {"X": reward, "O": 0.0}).episode
            episode.sample_index = sample
            episodes.append(episode)
    assert zero_variance_shares(episodes, AlgorithmConfig()) == {"a": 0.5, "b": 1.0}  # b's returns never differ


# ------------------------------------------------------------------------------ 3: fp32 master weights
def test_bfloat16_agents_keep_fp32_master_weights_so_small_updates_are_not_rounded_away():
    changed = {}
    for dtype in ("float32", "bfloat16"):
        trainer = make_trainer(dtype=dtype, lr=1e-5)
        result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=1))
        before = {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()}
        trainer.update(UpdateRequest(experiences=experiences(result.completions, [1.0, -1.0] * 4)))
        moved = total = 0
        for n, p in trainer.model.named_parameters():
            moved += int((p.detach().float() != before[n]).sum())
            total += p.numel()
        changed[dtype] = moved / total
    assert changed["float32"] > 0.99
    assert changed["bfloat16"] == pytest.approx(changed["float32"], abs=0.01)


def test_float16_agents_train_with_loss_scaling_over_fp32_master_weights():
    norms = {}
    for dtype in ("float32", "float16"):
        trainer = make_trainer(dtype=dtype)
        result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=1))
        before = trainer.parameters_digest()
        metrics = trainer.update(UpdateRequest(experiences=experiences(result.completions, [1.0, -1.0] * 4)))
        assert metrics.skipped_steps == 0 and trainer.parameters_digest() != before
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
        norms[dtype] = metrics.grad_norm
    assert trainer.scaler.is_enabled() and trainer.scaler.get_scale() > 1  # the gradient was scaled ...
    assert norms["float16"] == pytest.approx(norms["float32"], rel=0.05)  # ... and unscaled before clipping


def test_frozen_bfloat16_agent_stores_bfloat16_weights():
    trainer = make_trainer(dtype="bfloat16", trainable=False)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


# ------------------------------------------------------------------- 4: the model's generation config
def test_a_models_generation_config_changes_nothing_in_sampling(tmp_path):
    meddling = tiny_variant(tmp_path, "meddling", generation={"do_sample": True, "repetition_penalty": 1.1, "no_repeat_ngram_size": 2,
                                                               "min_p": 0.2, "typical_p": 0.5, "top_k": 3})
    request = GenerateRequest(prompts=["abababab", "Say a", "xyxyxy", "Say b"] * 4, seed=3,
                              max_completion_length=16)
    plain = make_trainer().generate(request).completions
    other = make_trainer(meddling).generate(request).completions
    assert [c.completion_ids for c in other] == [c.completion_ids for c in plain]
    assert [c.per_token_logps for c in other] == [c.per_token_logps for c in plain]


# --------------------------------------------------------------------------- 5: top-k / top-p log-probs
def reference_logps(trainer, completions, temperature, top_k, top_p):
    """Log-probs of each sampled token under softmax(logits / T) cut to top-k, then top-p, renormalised."""
    out = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        with torch.no_grad():
            logits = trainer.model(input_ids=ids).logits[0, len(c.prompt_ids) - 1:-1].double() / temperature
        row = []
        for pos, token in enumerate(c.completion_ids):
            probs = logits[pos].softmax(-1)
            order = probs.argsort(descending=True)
            kept, mass = [], 0.0
            for tok in order[:top_k].tolist():
                if mass >= top_p * float(probs[order[:top_k]].sum()):
                    break
                kept.append(tok)
                mass += float(probs[tok])
            assert token in kept, "a token outside the top-k / top-p set was sampled"
            row.append(math.log(float(probs[token]) / float(probs[kept].sum())))
        out.append(row)
    return out


def test_top_k_top_p_logps_describe_the_truncated_distribution_actually_sampled():
    settings = {"temperature": 0.7, "top_k": 5, "top_p": 0.9}
    trainer = make_trainer(generation=settings)
    result = trainer.generate(GenerateRequest(prompts=["Say a", "Say bb", "xyz"] * 4, seed=2))
    expected = reference_logps(trainer, result.completions, 0.7, 5, 0.9)
    for c, ref in zip(result.completions, expected):
        assert c.per_token_logps == pytest.approx(ref, abs=1e-4)
    # the update's log-probs of the same tokens are the same distribution's
    recomputed = trainer.per_token_logps(experiences(result.completions, [0.0] * 12))
    for c, logps in zip(result.completions, recomputed):
        assert logps == pytest.approx(c.per_token_logps, abs=1e-4)


def test_sampled_token_frequencies_match_the_behaviour_logps():
    trainer = make_trainer(generation={"top_k": 4, "top_p": 0.8, "max_completion_length": 1})
    result = trainer.generate(GenerateRequest(prompts=["Say a"] * 4000, seed=0))
    counts, logp = {}, {}
    for c in result.completions:
        token = c.completion_ids[0]
        counts[token] = counts.get(token, 0) + 1
        logp[token] = c.per_token_logps[0]
    assert 1 < len(counts) <= 4
    assert sum(math.exp(v) for v in logp.values()) == pytest.approx(1.0, abs=1e-5)  # only kept tokens, renormalised
    for token, n in counts.items():
        assert n / 4000 == pytest.approx(math.exp(logp[token]), abs=0.03)


# ---------------------------------------------------------------------------- 6: per-request temperature
def test_per_request_temperature_travels_with_the_completion_into_the_update():
    trainer = make_trainer(generation={"temperature": 1.0}, num_iterations=2)
    result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=4, temperature=0.5))
    assert {c.temperature for c in result.completions} == {0.5}
    exps = experiences(result.completions, [1.0, -1.0] * 4)
    assert {e.temperature for e in exps} == {0.5}
    for c, logps in zip(result.completions, trainer.per_token_logps(exps)):
        assert logps == pytest.approx(c.per_token_logps, abs=1e-4)
    metrics = trainer.update(UpdateRequest(experiences=exps))
    assert metrics.logp_mismatch < 1e-4


# ------------------------------------------------------------------------- 7: no (B, T, V) logits kept
def test_generate_never_materialises_logits_for_every_step():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        """Records the most elements of any tensor an op returns (not a view) whose last dimension is the vocabulary."""
        numel = 0

        def __init__(self, vocab):
            super().__init__()
            self.vocab = vocab

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dim() and t.size(-1) == self.vocab and not func.is_view:
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    B, T = 8, 32
    trainer = make_trainer(generation={"max_completion_length": T})
    V = trainer.model.config.vocab_size
    with Largest(V):
        result = trainer.generate(GenerateRequest(prompts=["Say a"] * B, seed=0))
    assert max(len(c.completion_ids) for c in result.completions) > 8  # long enough that (B, T, V) would show
    assert Largest.numel <= B * V  # one step's logits at most


# ------------------------------------------------------------------------------------- 8: dropout
def test_dropout_is_off_while_updating(tmp_path):
    dropping = tiny_variant(tmp_path, "dropping", attention_dropout=0.5)
    trainer = make_trainer(dropping)
    seen = []
    for module in trainer.model.modules():
        module.register_forward_pre_hook(lambda m, args: seen.append(m.training))
    result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=0, max_completion_length=8))
    seen.clear()
    metrics = trainer.update(UpdateRequest(experiences=experiences(result.completions, [1.0, -1.0] * 4)))
    assert seen and not any(seen)
    assert metrics.logp_mismatch < 1e-4  # the update's log-probs are the sampling policy's


# ---------------------------------------------------------------------- 9: extending the LR schedule
def test_extended_run_follows_the_new_schedule_from_the_restored_step(tmp_path):
    def trainer(total):
        agent = AgentConfig(model="builtin:tiny", optimizer={"lr": 1e-3, "lr_schedule": "cosine"},
                            generation={"max_completion_length": 2})
        return AgentTrainer("a", agent, AlgorithmConfig(), seed=0, total_updates=total)

    short = trainer(4)
    result = short.generate(GenerateRequest(prompts=["Say a", "Say b"], seed=0))
    exps = experiences(result.completions, [1.0, -1.0])
    assert [short.update(UpdateRequest(experiences=exps)).lr for _ in range(4)] == pytest.approx(
        [1e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)])
    short.save(tmp_path / "ckpt")
    longer = trainer(8)
    longer.load(tmp_path / "ckpt")
    lrs = [longer.update(UpdateRequest(experiences=exps)).lr for _ in range(4)]
    assert lrs == pytest.approx([1e-3 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(4, 8)])
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(lrs[-1])


# ----------------------------------------------------------------------------- 10: frozen agents
def test_frozen_agents_have_no_optimizer_and_no_reference():
    frozen = make_trainer(trainable=False, beta=0.1)
    assert frozen.optimizer is None and frozen.ref_model is None
    result = frozen.generate(GenerateRequest(prompts=["Say a"], seed=0))
    with pytest.raises(ValueError, match="agent 'a' is frozen"):
        frozen.update(UpdateRequest(experiences=experiences(result.completions, [1.0])))


def test_frozen_agents_weights_are_not_rewritten_at_each_checkpoint(tmp_path):
    raw = config(("a", "judge"), schedule={"kind": "simultaneous", "frozen": ["judge"]},
                 algorithm={"beta": 0.1}, train={"steps": 2, "checkpoint_every": 1})
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        coord.run()
        digests = coord.parameters_digests()
    for step in ("step-000001", "step-000002"):
        files = sorted(p.name for p in (tmp_path / "run" / "checkpoints" / step / "agents" / "judge").rglob("*"))
        assert files == ["source.json"]
        total = sum(p.stat().st_size for p in (tmp_path / "run" / "checkpoints" / step).rglob("*") if p.is_file())
        assert total < 3 * sum(p.stat().st_size for p in (tmp_path / "run" / "checkpoints" / step / "agents" / "a")
                               .rglob("*") if p.is_file()) / 2
    with Coordinator.resume(tmp_path / "run") as coord:
        assert coord.parameters_digests() == digests


def test_frozen_agent_refuses_a_changed_source(tmp_path):
    source = tiny_variant(tmp_path, "judge-weights")
    frozen = AgentTrainer("judge", AgentConfig(model=source), AlgorithmConfig(), trainable=False)
    frozen.save(tmp_path / "ckpt")
    weights = Path(source) / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # rewritten, same bytes: other times only, the same model
    fresh = AgentTrainer("judge", AgentConfig(model=source), AlgorithmConfig(), trainable=False)
    fresh.load(tmp_path / "ckpt")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # other weights
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"agent 'judge': checkpoint .* refers to model .* the contents differ \(model.safetensors\)"):
        fresh.load(tmp_path / "ckpt")


# --------------------------------------------------------------------------------- 11: NaN
def test_nan_advantage_is_refused_before_any_agent_trains():
    with Coordinator(validate_config(config())) as coord:
        out = coord.generate({"a": ["Say a", "Say b"], "b": ["Say c", "Say d"]}, seed=3)
        before = coord.parameters_digests()
        bad = {"a": experiences(out["a"], [1.0, -1.0]), "b": experiences(out["b"], [0.5, float("nan")])}
        with pytest.raises(ValueError, match=r"agent 'b': experience 1: advantage is nan"):
            coord.train(bad)
        assert coord.parameters_digests() == before
        poisoned = [e.model_copy(update={"old_per_token_logps": [float("-inf")] * len(e.completion_ids)})
                    for e in bad["a"]]
        with pytest.raises(ValueError, match=r"agent 'a': experience 0: old_per_token_logps\[0\] is -inf"):
            coord.train({"a": poisoned})


def test_non_finite_gradient_never_reaches_the_weights():
    trainer = make_trainer()
    result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 2, seed=0))
    exps = experiences(result.completions, [1.0, -1.0] * 2)
    before = trainer.parameters_digest()
    hook = trainer.model.lm_head.weight.register_hook(lambda g: g * float("nan"))
    metrics = trainer.update(UpdateRequest(experiences=exps))
    hook.remove()
    assert metrics.skipped_steps == 1 and math.isnan(metrics.grad_norm)
    assert trainer.parameters_digest() == before
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    after = trainer.update(UpdateRequest(experiences=exps))  # the optimizer state is intact: training goes on
    assert after.skipped_steps == 0 and math.isfinite(after.grad_norm) and trainer.parameters_digest() != before


def test_no_checkpoint_is_written_from_non_finite_weights(tmp_path):
    raw = config(train={"steps": 1})
    with Coordinator(validate_config(raw), tmp_path) as coord:
        coord.run()
        good = coord.log.latest_checkpoint()
        coord.pool.trainers["a"].model.lm_head.weight.data[0, 0] = float("nan")
        with pytest.raises(Exception, match=r"agent 'a'.*not finite"):
            coord.checkpoint(step=2)
        assert coord.log.latest_checkpoint() == good


# --------------------------------------------------------------------------- 12: resume as a context
def test_resume_as_a_context_manager_keeps_the_restored_trainers(tmp_path):
    raw = config(train={"steps": 2})
    with Coordinator(validate_config(raw), tmp_path) as coord:
        coord.run()
        trained = coord.parameters_digests()
    resumed = Coordinator.resume(tmp_path)
    trainers = resumed.pool
    with resumed as coord:
        assert coord.pool is trainers
        assert coord.parameters_digests() == trained
        assert coord.state.step == 2


# ------------------------------------------------------------------ 13: truncated importance sampling
def shifted(exps, by):
    """The experiences as if an engine had reported behaviour log-probs `by` nats off the learner's."""
    return [e.model_copy(update={"old_per_token_logps": [v - by for v in e.old_per_token_logps]}) for e in exps]


def gradient(trainer, exps):
    """The update's gradient as the optimizer would see it, unclipped."""
    trainer.agent = trainer.agent.model_copy(update={"optimizer": trainer.agent.optimizer.model_copy(
        update={"max_grad_norm": None})})
    grads = []
    trainer.optimizer.step = lambda: grads.append([p.grad.clone() for p in trainer.model.parameters()])
    metrics = trainer.update(UpdateRequest(experiences=exps))
    return grads[0], metrics


def test_tis_weights_each_token_by_the_learner_over_the_engine_probability_truncated_at_the_cap():
    result = make_trainer().generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=5))
    exps = experiences(result.completions, [1.0, -1.0, 0.5, -0.5] * 2)
    plain, off = gradient(make_trainer(), shifted(exps, math.log(1.25)))
    assert off.tis_weight is None and off.logp_mismatch == pytest.approx(math.log(1.25), abs=1e-4)
    # the engine gave every token 1/1.25 of the learner's probability: every weight is 1.25, under the cap
    weighted, on = gradient(make_trainer(rollout={"tis_cap": 2.0}), shifted(exps, math.log(1.25)))
    assert on.tis_weight == pytest.approx(1.25, abs=1e-4) and on.tis_truncated == 0.0
    for g, h in zip(plain, weighted):
        assert torch.allclose(h, 1.25 * g, atol=1e-7, rtol=1e-4)
    # e^1 > cap: every weight is cut to the cap
    capped, on = gradient(make_trainer(rollout={"tis_cap": 2.0}), shifted(exps, 1.0))
    assert on.tis_weight == pytest.approx(2.0) and on.tis_truncated == 1.0
    assert on.logp_gap_max == pytest.approx(1.0, abs=1e-4)
    for g, h in zip(plain, capped):
        assert torch.allclose(h, 2.0 * g, atol=1e-7, rtol=1e-4)


def test_with_tis_the_ppo_ratio_is_taken_against_the_learners_own_log_probs():
    result = make_trainer().generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=5))
    exps = shifted(experiences(result.completions, [1.0, -1.0, 0.5, -0.5] * 2), 1.0)
    # against the behaviour log-probs every ratio is about e^1: clipped wherever the advantage is positive
    against_behaviour = make_trainer(lr=1e-5, num_iterations=2, epsilon=0.2).update(UpdateRequest(experiences=exps))
    assert against_behaviour.clip_fraction == pytest.approx(0.5, abs=0.1)
    # with TIS the denominator is the learner's first-pass log-prob: ratios stay near 1 after a small step
    against_learner = make_trainer(lr=1e-5, num_iterations=2, epsilon=0.2, rollout={"tis_cap": 2.0}).update(
        UpdateRequest(experiences=exps))
    assert against_learner.clip_fraction == 0.0


def test_tis_defaults_on_for_vllm_and_stale_actions_and_off_for_hf():
    from protocols.config import RolloutConfig, stored_form, tis_cap_of, validate_config
    from protocols.plan import plan_of

    assert tis_cap_of(RolloutConfig(), 0) is None and tis_cap_of(RolloutConfig(engine="vllm"), 0) == 2.0
    assert tis_cap_of(RolloutConfig(), 1) == 2.0  # actions that may be a version behind
    assert tis_cap_of(RolloutConfig(engine="vllm", tis_cap=None), 1) is None and tis_cap_of(RolloutConfig(tis_cap=3.0), 0) == 3.0
    # the run's plan gives each trainer its bound; the config keeps what was written ("auto"), so a stored config
    # read back on resume means the same
    raw = config(("a", "b"), train={"max_staleness": 1})
    raw["agents"]["b"]["rollout"] = {"max_staleness": 0}
    cfg = validate_config(raw)
    assert {a: spec.rollout.tis_cap for a, spec in cfg.agents.items()} == {"a": "auto", "b": "auto"}
    bounds = plan_of(cfg).staleness_bounds
    assert {a: tis_cap_of(spec.rollout, bounds[a]) for a, spec in cfg.agents.items()} == {"a": 2.0, "b": None}
    assert validate_config(stored_form(cfg)) == cfg


# ------------------------------------------------------------------------------------ smaller
def test_grad_norm_is_the_mean_over_iterations(monkeypatch):
    norms = []
    clip = torch.nn.utils.clip_grad_norm_

    def recording(params, max_norm):
        norm = clip(params, max_norm)
        norms.append(float(norm))
        return norm

    monkeypatch.setattr(trainer_module.torch.nn.utils, "clip_grad_norm_", recording)
    trainer = make_trainer(lr=5e-2, num_iterations=3)
    result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=0))
    metrics = trainer.update(UpdateRequest(experiences=experiences(result.completions, [1.0, -1.0] * 4)))
    assert len(norms) == 3 and len(set(norms)) == 3
    assert metrics.grad_norm == pytest.approx(statistics.fmean(norms))


def test_scheduled_agent_without_experiences_is_counted_and_warned_once(capfd):
    raw = config(("a", "b"), train={"steps": 3})
    raw["environment"]["kwargs"]["silent"] = ["r1"]  # b's seat is never prompted
    with Coordinator(validate_config(raw)) as coord:
        history = coord.run()
    assert [m["trained"] for m in history] == [["a"]] * 3
    assert [m.get("no_experiences/b") for m in history] == [1] * 3
    err = capfd.readouterr().err
    assert err.count("agent 'b' is scheduled to train but got no experiences") == 1

