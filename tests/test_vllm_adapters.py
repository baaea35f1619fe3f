"""Adapter agents sampling with vLLM (`rollout.engine: vllm` with `agents.NAME.adapter`), real: one vLLM engine per
host serves the base once and each agent's LoRA adapter (multi-LoRA), colocated in the host or apart."""

from __future__ import annotations

import os

import pytest
import ray
import torch

pytest.importorskip("vllm", reason="the vllm extra is not installed (make setup installs it)")

from agent_trainer.adapters import AdapterTrainer, SharedBase  # noqa: E402
from agent_trainer.agent import Agent  # noqa: E402
from agent_trainer.engine_vllm import AdapterSlots  # noqa: E402
from orchestrator.coordinator import Coordinator  # noqa: E402
from orchestrator.steplog import computed  # noqa: E402
from protocols.config import AgentConfig, AlgorithmConfig, validate_config  # noqa: E402
from protocols.messages import Experience, GenerateRequest, UpdateRequest  # noqa: E402
from tests.runs import rows, run_killing, without_times  # noqa: E402
from tests.test_adapters import AGENTS, shared_host_config  # noqa: E402
from tests.test_vllm import PARITY, VLLM, fixed_sequence, gap  # noqa: E402

LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}


def test_an_adapter_on_the_output_head_samples_as_its_learner_and_its_engine_refuses_to_score():
    """First in the module: vLLM keeps one parallel state per process, and closing a LoRA engine while another
    serves in the same process breaks the other (vLLM 0.32), so this engine goes before `pair` starts."""
    agent = AgentConfig(model="builtin:tiny", dtype="float32", optimizer={"lr": 1e-2}, rollout=VLLM,
                        generation={"max_completion_length": 6},
                        adapter={**LORA, "target_modules": ["q_proj", "lm_head"]})
    trainer = AdapterTrainer("h", agent, AlgorithmConfig())
    try:
        with torch.no_grad():  # B = 0 would leave the head's adapter out of the sum
            for p in trainer.shared.parts("h")[0].values():
                p.normal_(0, 0.05)
        trainer.engine.sync(trainer.model)
        with trainer.selected():
            result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 2, seed=0))
            experiences = [Experience.from_completion(c, 0.0) for c in result.completions]
            learner = trainer.per_token_logps(experiences)
            assert gap(learner, [c.per_token_logps for c in result.completions]) < PARITY
            with trainer.model.disable_adapter():
                assert gap(learner, trainer.per_token_logps(experiences)) > 1e-2  # the adapter counts
            with pytest.raises(ValueError, match="adapter on the output head"):
                trainer.score(experiences, engine=True)
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def pair():
    """Adapter agents a and b on one base, sampling with one vLLM engine in this process."""
    base = SharedBase(engine_slots=AdapterSlots(rank=8, count=2))
    trainers = {}
    for name, rank in (("a", 4), ("b", 8)):
        agent = AgentConfig(model="builtin:tiny", dtype="float32", optimizer={"lr": 1e-2}, rollout=VLLM,
                            generation={"max_completion_length": 6, "temperature": 0.8, "top_k": 20},
                            adapter={**LORA, "rank": rank})
        trainers[name] = AdapterTrainer(name, agent, AlgorithmConfig(), base=base, seed=len(trainers))
    yield trainers
    for trainer in trainers.values():
        trainer.close()


def engine_gap(trainer, fixed) -> float:
    with trainer.selected():
        return gap(trainer.score(fixed, engine=True), trainer.score(fixed))


def test_each_agent_samples_with_its_own_adapter_and_an_update_reaches_only_its_own(pair):
    from peft.utils import get_peft_model_state_dict

    a, b = pair["a"], pair["b"]
    assert a.engine.engine is b.engine.engine and a.engine.lora_id != b.engine.lora_id  # one engine, two slots
    for trainer in (a, b):  # what a sync writes is what peft saves
        saved = get_peft_model_state_dict(trainer.model, adapter_name=trainer.engine.adapter)
        sent = trainer.engine.weights()
        assert sent.keys() == saved.keys() and all(torch.equal(sent[n], saved[n]) for n in saved)
    fixed = fixed_sequence(a)
    for step in range(3):
        for trainer, other in ((a, b), (b, a)):
            with trainer.selected():
                result = trainer.generate(GenerateRequest(prompts=["Say a", "Say b"] * 4, seed=step))
                # the behaviour log-probs are the learner's: the engine sampled with this agent's adapter
                experiences = [Experience.from_completion(c, adv)
                               for c, adv in zip(result.completions, [1.0, -1.0, 0.5, -0.5] * 2)]
                behaviour = [c.per_token_logps for c in result.completions]
                assert gap(trainer.per_token_logps(experiences), behaviour) < PARITY
            with other.selected():
                other_before = other.score(fixed, engine=True)
            with trainer.selected(updating=True):
                before = trainer.score(fixed)
                metrics = trainer.update(UpdateRequest(experiences=experiences))
            assert metrics.logp_gap_max < PARITY
            with trainer.selected():
                assert gap(before, trainer.score(fixed)) > 1e-3  # the adapter moved
            assert engine_gap(trainer, fixed) < PARITY  # and its engine slot followed
            with other.selected():
                assert other.score(fixed, engine=True) == other_before  # the other slot did not
    assert engine_gap(a, fixed) < PARITY and engine_gap(b, fixed) < PARITY
    with a.selected():
        learned_a = a.score(fixed)
    with b.selected():
        assert gap(learned_a, b.score(fixed)) > 1e-3  # two policies, not one


def test_a_loaded_adapter_reaches_its_engine_slot(pair, tmp_path):
    a = pair["a"]
    with a.selected():
        a.save(tmp_path / "a")
        fixed = fixed_sequence(a)
        saved = a.score(fixed)
        with torch.no_grad():
            for p in a.shared.parts("a")[0].values():
                p.add_(0.05)
        a.engine.sync(a.model)
        assert gap(a.score(fixed, engine=True), saved) > 1e-3
        a.load(tmp_path / "a")
        assert gap(a.score(fixed, engine=True), saved) < PARITY and gap(a.score(fixed), saved) == 0


def test_a_sync_writes_the_adapter_elsewhere_where_shared_memory_refuses_it_and_leaves_nothing(pair, tmp_path,
                                                                                                monkeypatch):
    import tempfile

    from agent_trainer import engine_vllm_adapters

    a, full = pair["a"], tmp_path / "full"
    full.write_text("")  # not a directory: writing there fails as a full /dev/shm does
    spare = tmp_path / "tmp"
    spare.mkdir()
    monkeypatch.setattr(engine_vllm_adapters, "_FOLDERS", (str(full), None))
    monkeypatch.setattr(tempfile, "tempdir", str(spare))
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **kw: made.append(mkdtemp(*a, **kw)) or made[-1])
    with a.selected():
        fixed = fixed_sequence(a)
        with torch.no_grad():
            for p in a.shared.parts("a")[0].values():
                p.add_(0.01)
        assert gap(a.score(fixed, engine=True), a.score(fixed)) > 1e-4
        a.engine.sync(a.model)
        assert gap(a.score(fixed, engine=True), a.score(fixed)) < PARITY
    made = [m for m in made if os.path.basename(m).startswith("marsi-adapter-")]
    assert len(made) == 1 and made[0].startswith(str(spare))  # /dev/shm's stand-in refused, the fallback took it
    assert list(spare.iterdir()) == []


def _vllm_host(placement: str, staleness: int = 0) -> dict:
    """Host h's three adapter agents sampling with one vLLM engine: in the host's process (in-process run) or
    apart (Ray), rollouts `staleness` steps ahead at most."""
    raw = shared_host_config(train={"steps": 3, "max_staleness": staleness})
    for name in AGENTS:
        raw["agents"][name]["adapter"]["target_modules"] = "all-linear"
        raw["agents"][name]["rollout"] = dict(VLLM)
    if placement == "separate":
        raw["ray"]["enabled"] = True
        for name in AGENTS:
            raw["agents"][name]["rollout"].update(placement="separate", resources={"num_cpus": 0.25})
    return raw


def test_one_vllm_engine_apart_serves_a_shared_hosts_adapters_as_the_host_itself(ray_cluster):
    """With max_staleness 0 the run's metrics (the engine's log-prob gap included) are the colocated run's, update
    for update; apart, one engine process holds the three adapters and the learner's process starts no vLLM."""
    runs = {}
    for placement in ("colocated", "separate"):
        with Coordinator(validate_config(_vllm_host(placement)), None) as coord:
            info = coord.pool.info()
            if placement == "separate":
                assert len({info[a]["rollout_engine"]["pid"] for a in AGENTS}) == 1
                assert {(info[a]["engine"], info[a]["rollout_engine"]["engine"]) for a in AGENTS} == {("hf", "vllm")}
            else:
                assert {info[a]["engine"] for a in AGENTS} == {"vllm"}
            runs[placement] = coord.run()
            if placement == "separate":
                learned = {a: d.model_dump() for a, d in coord.pool.ask(Agent.weight_digests, AGENTS).items()}
                for agent in AGENTS:
                    coord.pool.push_weights(agent)
                    engine = ray.get(coord.pool.engines[agent].call.remote(agent, "weight_digests")).model_dump()
                    assert engine == learned[agent]
    assert [computed(r) for r in runs["separate"]] == [computed(r) for r in runs["colocated"]]
    assert all(runs["colocated"][-1][f"rollout/logp_gap_max/{a}"] < PARITY for a in runs["colocated"][-1]["trained"])


def test_a_killed_vllm_engine_apart_restarts_and_the_run_ends_as_if_uninterrupted(ray_cluster, tmp_path):
    """Rollouts one step ahead (K = 1): bounded by 1; the host's vLLM engine apart SIGKILLed mid-run restarts once,
    with the host, from the last checkpoint, and the run's metrics are the uninterrupted run's."""
    runs = {}
    for name in ("whole", "killed"):
        raw = _vllm_host("separate", staleness=1)
        raw["train"].update(checkpoint_every=1, keep_checkpoints=5)
        with Coordinator(validate_config(raw), tmp_path / name) as coord:
            if name == "killed":
                run_killing(coord, coord.pool.start_info["b"]["rollout_engine"]["pid"], at_step=2)
                assert coord.restarts == 1
            else:
                coord.run()
        runs[name] = without_times(rows(tmp_path / name))
    assert runs["killed"] == runs["whole"]
    assert max(row.get(f"staleness/{a}/max", 0) for row in runs["whole"] for a in AGENTS) == 1
