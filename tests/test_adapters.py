"""Adapter agents on shared hosts, on the real tiny model: isolation of adapters, KL against the base,
checkpoints that plain peft loads, export, Ray hosts restarted whole with exact resume, config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from agent_trainer import storage
from agent_trainer.adapters import AdapterTrainer
from agent_trainer.agent import Agent
from agent_trainer.models import resolve_model_path
from orchestrator.coordinator import Coordinator
from orchestrator.runlog import RunLog
from orchestrator.steplog import computed
from protocols.config import AgentConfig, AlgorithmConfig, ConfigError, EnginePriority, validate_config
from protocols.messages import Experience, LoadRequest, Location, ScoreRequest, UpdateRequest
from protocols.plan import plan_of
from tests.loops import say_the_letter_curve
from tests.envs import HERE, config
from tests.errors_doc import assert_documented
from tests.runs import rows, without_times, run_killing

AGENTS = ("a", "b", "c")
STEPS = 4


def shared_host_config(**sections) -> dict:
    """a, b and c: adapter agents on one host; a and b train in turn, c is frozen; the reward varies from the start."""
    raw = config(agents=AGENTS, environment={"name": f"{HERE / 'envs.py'}:ByteScoreEnv"},
                 hosts={"h": {"resources": {"num_cpus": 0.5}}},
                 schedule={"kind": "pattern", "pattern": [["a"], ["b"]], "frozen": ["c"]},
                 algorithm={"beta": 0.1}, **sections)
    for name in AGENTS:
        agent = raw["agents"][name]
        del agent["resources"]
        agent.update(host="h", adapter={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj", "lm_head"]},
                     optimizer={"lr": 1e-2})
    return raw


def digests(coord) -> dict[str, dict[str, str]]:
    return {a: d.model_dump() for a, d in coord.pool.ask(Agent.weight_digests, AGENTS).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted in-process run with a checkpoint every step, and each step's weight digests."""
    run_dir = tmp_path_factory.mktemp("adapters")
    raw = shared_host_config(train={"steps": STEPS, "checkpoint_every": 1, "keep_checkpoints": 5})
    steps = []
    with Coordinator(validate_config(raw), run_dir) as coord:
        trainers = coord.pool.trainers
        assert trainers["a"].model is trainers["b"].model is trainers["c"].model  # one copy of the base
        steps.append(digests(coord))
        for step in range(1, STEPS + 1):
            coord.run(until=step)
            steps.append(digests(coord))
    return run_dir, steps, without_times(rows(run_dir))


def test_an_update_changes_only_its_agents_adapter_never_the_base_or_another_adapter(reference):
    _, steps, metrics = reference
    assert len({d["base"] for s in steps for d in s.values()}) == 1  # the shared base never moves
    for step, (before, after) in enumerate(zip(steps, steps[1:]), start=1):
        trained = metrics[step - 1]["trained"]
        assert trained == ["ab"[(step - 1) % 2]]  # the pattern alternates a, b
        changed = [a for a in AGENTS if before[a]["adapter"] != after[a]["adapter"]]
        assert changed == trained, f"step {step}"
    assert steps[0]["c"] == steps[-1]["c"]  # the frozen adapter agent
    # KL against the base with the adapters off: 0 at a's first update (B = 0), positive once its adapter moved
    assert metrics[0]["kl/a"] == pytest.approx(0.0, abs=1e-7) and metrics[2]["kl/a"] > 0


def test_checkpoint_holds_adapters_only_loads_with_peft_and_exports_a_merged_model(reference, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agent_trainer.engines import model_logps
    from orchestrator.cli import main

    run_dir, _, _ = reference
    checkpoint = RunLog(run_dir).latest_checkpoint()
    saved = storage.on_disk(checkpoint / "agents" / "a")
    assert sorted(p.name for p in saved.iterdir()) == ["adapter", "trainer_state.pt"]  # no base weights
    base_bytes = (Path(resolve_model_path("builtin:tiny")) / "model.safetensors").stat().st_size
    assert (saved / "adapter" / "adapter_model.safetensors").stat().st_size < base_bytes / 10
    assert (saved.parent / "c" / "source.json").exists()
    config = validate_config(shared_host_config())
    trainer = Agent(AdapterTrainer("a", config.agents["a"], config.algorithm))
    assert trainer.load(LoadRequest(source=Location.parse(saved))) is None
    prompts, completions = [[10, 20, 30], [40, 50]], [[60, 70], [80]]
    experiences = [Experience(prompt_ids=p, completion_ids=c, advantage=0.0) for p, c in zip(prompts, completions)]
    trained = flat(trainer.score(ScoreRequest(experiences=experiences)))
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny"))
    untrained = flat(model_logps(base, prompts, completions, "cpu"))
    assert max(abs(x - y) for x, y in zip(trained, untrained)) > 1e-4  # the adapter moved the agent off its base
    with_peft = PeftModel.from_pretrained(base, saved / "adapter").eval()
    assert flat(model_logps(with_peft, prompts, completions, "cpu")) == pytest.approx(trained, abs=1e-6)
    assert main(["export", str(run_dir), "--agent", "a", "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert flat(model_logps(merged, prompts, completions, "cpu")) == pytest.approx(trained, abs=1e-5)
    with pytest.raises(ConfigError) as info:
        cmd_export(run_dir, "a", tmp_path / "merged")
    assert_documented("export_out_not_empty", info.value, DIR=tmp_path / "merged")
    with pytest.raises(ConfigError) as info:
        cmd_export(run_dir, "zed", tmp_path / "other")
    assert_documented("export_unknown_agent", info.value, RUN=run_dir)


def test_a_frozen_agent_on_the_host_can_play_a_saved_adapter(reference):
    """A frozen judge from a checkpoint's adapter (adapter.path) joins the host: no extra base, the saved policy."""
    from agent_trainer.hosts import Host

    run_dir, _, _ = reference
    saved = storage.on_disk(RunLog(run_dir).latest_checkpoint() / "agents" / "a")
    raw = shared_host_config()
    raw["agents"]["c"]["adapter"] = {"path": str(saved / "adapter")}
    config = validate_config(raw)
    host = Host("h", config, plan_of(config), {a: 1 for a in AGENTS})
    trained = Agent(AdapterTrainer("a", validate_config(shared_host_config()).agents["a"], config.algorithm))
    trained.load(LoadRequest(source=Location.parse(saved)))
    experiences = [Experience(prompt_ids=[10, 20, 30], completion_ids=[60, 70], advantage=0.0)]
    judge = flat(host.call("c", Agent.score, ScoreRequest(experiences=experiences)))
    assert judge == pytest.approx(flat(trained.score(ScoreRequest(experiences=experiences))), abs=1e-6)
    assert flat(host.call("a", Agent.score, ScoreRequest(experiences=experiences))) != judge  # a starts afresh on the base
    assert host.trainers["c"].model is host.trainers["a"].model
    with pytest.raises(ValueError, match="agent 'c' is frozen"):
        host.call("c", Agent.update, UpdateRequest(experiences=experiences))


def cmd_export(run_dir, agent, out):
    from argparse import Namespace

    from orchestrator.cli import cmd_export

    return cmd_export(Namespace(run_dir=str(run_dir), agent=agent, out=str(out), checkpoint="last"))


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def test_killed_host_restarts_once_with_all_its_agents_and_resumes_exactly(ray_cluster, tmp_path, reference):
    raw = shared_host_config(train={"steps": STEPS, "checkpoint_every": 1, "keep_checkpoints": 5})
    raw["ray"]["enabled"] = True
    with Coordinator(validate_config(raw), tmp_path) as coord:
        pids = {a: i["pid"] for a, i in coord.pool.info().items()}
        assert len(set(pids.values())) == 1 and sorted(pids) == list(AGENTS)  # one process for the three

        run_killing(coord, pids["a"], at_step=2)
        assert coord.restarts == 1
        after = {a: i["pid"] for a, i in coord.pool.info().items()}
        assert len(set(after.values())) == 1 and after["a"] != pids["a"]
    assert without_times(rows(tmp_path)) == reference[2]


def test_an_adapter_agent_learns_to_say_the_named_letter():
    """The plain loop of test_trainer on a LoRA adapter (every linear layer and the output head, as the adapter
    demo): mean reward rises from near 0 to the level of one letter right (README: on this random tiny model an
    adapter learns less than full fine-tuning, which trains the embedding too)."""
    torch.set_num_threads(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    agent = AgentConfig(model="builtin:tiny", generation={"max_completion_length": 2}, optimizer={"lr": 1e-2},
                        adapter={"rank": 8, "alpha": 16, "target_modules": targets})
    trainer = Agent(AdapterTrainer("a", agent, AlgorithmConfig()))
    curve = say_the_letter_curve(trainer.generate, trainer.update, 40)
    assert sum(curve[:10]) / 10 < 0.05 and sum(curve[-10:]) / 10 > 0.15


def test_validate_prints_who_lives_where(tmp_path, capsys):
    from orchestrator.cli import main
    from tests.runs import write

    assert main(["validate", str(write(tmp_path, shared_host_config())), "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "host h: a (adapter r=4), b (adapter r=4), c (adapter r=4); 0.5 CPUs, 0 GPUs, one copy of builtin:tiny" in out


def _edit(change):
    raw = shared_host_config()
    change(raw)
    return raw


@pytest.mark.parametrize("case, change", [
    ("adapter_missing_on_host", lambda r: r["agents"]["b"].pop("adapter")),
    ("host_base_differs", lambda r: r["agents"]["c"].update(dtype="bfloat16")),
    ("host_engine_differs", lambda r: (r["ray"].update(enabled=True),
                                       r["agents"]["b"].update(rollout={"placement": "separate"}))),
    ("host_undefined", lambda r: r["agents"]["a"].update(host="nowhere")),
    ("hosted_agent_resources", lambda r: r["agents"]["a"].update(resources={"num_cpus": 2})),
    ("host_unused", lambda r: r["hosts"].update(spare={})),
    ("adapter_vllm_sleep_mode", lambda r: [r["agents"][a].update(rollout={"engine": "vllm",
                                                                          "vllm": {"sleep_mode": True}})
                                           for a in AGENTS]),
    ("adapter_rank_above_vllm", lambda r: ([r["agents"][a].update(rollout={"engine": "vllm"}) for a in AGENTS],
                                           r["agents"]["a"]["adapter"].update(rank=1024))),
    ("adapter_path_and_settings", lambda r: r["agents"]["a"].update(adapter={"rank": 4, "path": "/tmp"})),
    ("adapter_path_not_adapter", lambda r: r["agents"]["a"].update(adapter={"path": "/"})),
    ("adapter_path_with_beta", lambda r: (r["agents"]["a"].update(adapter={"path": str(HERE / "fixtures" / "adapter")}),
                                          r.setdefault("algorithm", {}).update(beta=0.1))),
    ("adapter_agent_name_dot", lambda r: (r["agents"].update({"c.d": r["agents"].pop("c")}),
                                          r["roles"]["assignment"].update(r2="c.d"), r["schedule"].update(frozen=["c.d"]))),
    ("host_named_like_agent", lambda r: (r["agents"]["a"].pop("host"), r["hosts"].update(a={}))),
])
def test_bad_host_and_adapter_settings_are_one_line_errors(case, change):
    with pytest.raises(ConfigError) as info:
        validate_config(_edit(change), source="run.yaml")
    assert_documented(case, info.value)


@pytest.mark.fast
def test_a_hosted_agent_runs_on_its_hosts_resources_and_its_config_reads_back_as_written():
    """Validation fills nothing in: the host's resources are derived (`agent_resources`, the plan), and the stored
    config of a run (every field written out) validates again to the same config, as on resume."""
    from protocols.config import ResourcesConfig, agent_resources, stored_form
    from protocols.plan import plan_of

    cfg = validate_config(shared_host_config())
    assert all(cfg.agents[a].resources == ResourcesConfig() for a in AGENTS)  # as written: not given
    assert {a: agent_resources(cfg, a).num_cpus for a in AGENTS} == {"a": 0.5, "b": 0.5, "c": 0.5}
    assert plan_of(cfg).host_resources == {"h": cfg.hosts["h"].resources}
    assert "resources" not in stored_form(cfg)["agents"]["a"]  # the host's: a stored config does not repeat them
    assert validate_config(stored_form(cfg)) == cfg


def test_evaluation_partners_of_adapter_agents_get_a_host_of_their_own(tmp_path):
    from orchestrator.evaluation import partner_agents

    saved = tmp_path / "step-000004" / "agents" / "a"
    (saved / "adapter").mkdir(parents=True)
    (saved / "adapter" / "adapter_config.json").write_text("{}")
    raw = shared_host_config(eval={"data": {"factory": f"{HERE / 'envs.py'}:held_out"},
                                   "partners": {"first": {"b": "initial"}, "saved": {"a": str(saved)}}})
    partners = partner_agents(validate_config(raw))
    assert sorted(partners) == ["a@saved", "b@first"]
    for partner in partners.values():
        assert partner.host is None and partner.resources.num_cpus == 0.1
    assert partners["b@first"].adapter.path is None and partners["b@first"].adapter.rank == 4
    assert partners["a@saved"].adapter.path == str(saved / "adapter")


def _own_adapter(placement: str) -> dict:
    """One adapter agent on a host of its own, its engine colocated (in-process) or apart (Ray), rollouts one step
    ahead."""
    raw = config(agents=("a",), environment={"name": f"{HERE / 'envs.py'}:ByteScoreEnv"}, ray=placement == "separate",
                 train={"steps": 3, "max_staleness": 1})
    raw["agents"]["a"].update(adapter={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj", "lm_head"]},
                              optimizer={"lr": 1e-2}, resources={"num_cpus": 0.5})
    if placement == "separate":
        raw["agents"]["a"]["rollout"] = {"placement": "separate", "resources": {"num_cpus": 0.5}}
    return raw


def test_an_adapter_agents_engine_of_its_own_takes_only_the_adapter_and_samples_as_the_colocated_one(ray_cluster):
    runs = {}
    for placement in ("colocated", "separate"):
        with Coordinator(validate_config(_own_adapter(placement)), None) as coord:
            runs[placement] = coord.run()
            if placement == "separate":
                info = coord.pool.info()["a"]
                assert info["rollout_engine"]["pid"] != info["pid"]
                published = coord.pool.ask(Agent.published_weights, ["a"])["a"]["arrays"]
                assert published and all(".lora_" in name for name in published)  # the adapter, never the base
                engine = ray.get(coord.pool.engines["a"].call.remote("a", "weight_digests"))
                assert engine.base == coord.pool.ask(Agent.weight_digests, ["a"])["a"].base  # its own copy
    assert [computed(r) for r in runs["separate"]] == [computed(r) for r in runs["colocated"]]
    assert runs["separate"][-1]["staleness/a/max"] == 1


def _shared_host(placement: str) -> dict:
    """The three adapter agents of host h, rollouts one step ahead; their engine in their host's process
    (in-process), or one engine apart for the three (Ray)."""
    raw = shared_host_config(train={"steps": 3, "max_staleness": 1})
    if placement == "separate":
        raw["ray"]["enabled"] = True
        for name in AGENTS:
            raw["agents"][name]["rollout"] = {"placement": "separate", "resources": {"num_cpus": 0.5}}
    return raw


@pytest.mark.fast
def test_a_shared_hosts_agents_have_one_engine_apart_on_its_rollout_resources():
    raw = _shared_host("separate")
    for name in AGENTS:
        raw["agents"][name]["rollout"]["resources"] = {"num_cpus": 0.25}
    plan = plan_of(validate_config(raw))
    assert plan.engine_layout == {"h": list(AGENTS)}
    assert plan.engine_resources["h"].num_cpus == 0.25 and plan.host_resources["h"].num_cpus == 0.5
    assert plan.engine_priority == {"h": EnginePriority(idle=True)}  # auto, without a GPU
    for name in AGENTS:
        del raw["agents"][name]["rollout"]["resources"]
    assert plan_of(validate_config(raw)).engine_resources["h"].num_cpus == 0.5  # none given: the host's
    raw["agents"]["c"]["rollout"]["nice"] = 3
    with pytest.raises(ConfigError, match=r"agents\.c\.rollout\.nice: 3 differs from agents\.a\.rollout\.nice 'auto'"):
        validate_config(raw)
    for bad in (20, -1, True, "high"):
        raw["agents"]["c"]["rollout"]["nice"] = bad
        with pytest.raises(ConfigError, match=r"agents\.c\.rollout\.nice: Input should be an integer from 0 to "
                                              r"19, auto or idle"):
            validate_config(raw)


def test_validate_prints_the_shared_hosts_engine_apart(tmp_path, capsys):
    from orchestrator.cli import main
    from tests.runs import write

    assert main(["validate", str(write(tmp_path, _shared_host("separate"))), "--steps", "1"]) == 0
    assert ("rollout engine apart, host h: a, b, c; 0.5 CPUs, 0 GPUs, one copy of builtin:tiny and 3 adapters"
            in capsys.readouterr().out)


def test_one_engine_apart_serves_every_adapter_of_a_shared_host_and_samples_as_the_host_itself(ray_cluster,
                                                                                                tmp_path):
    """Multi-LoRA: one engine process holds the base once and each agent's adapter, takes each adapter from its
    learner over a weight channel of its own, and samples as the agents' own host does; killed mid-run, it
    restarts with the host and the run ends as if uninterrupted."""
    runs = {}
    for placement in ("colocated", "separate"):
        with Coordinator(validate_config(_shared_host(placement)), tmp_path / placement) as coord:
            runs[placement] = coord.run()
            if placement == "separate":
                pool, info = coord.pool, coord.pool.info()
                assert len({info[a]["rollout_engine"]["pid"] for a in AGENTS}) == 1  # one engine for the three
                assert info["a"]["rollout_engine"]["pid"] != info["a"]["pid"]
                engine = info["a"]["rollout_engine"]  # auto, on CPU: the idle class
                assert (engine["scheduler"], info["a"]["scheduler"]) == ("idle", "normal")
                assert all(pool.start_info[a]["weight_transfer"] == "a gloo group with its learner, into shared "
                           "memory on their node" for a in AGENTS)
                learned = digests(coord)
                for agent in AGENTS:
                    pool.push_weights(agent)
                    engine = ray.get(pool.engines[agent].call.remote(agent, "weight_digests")).model_dump()
                    assert engine == learned[agent]  # the one base, and this agent's adapter as its learner has it
                assert learned["a"]["adapter"] != learned["b"]["adapter"] != learned["c"]["adapter"]
    assert [computed(r) for r in runs["separate"]] == [computed(r) for r in runs["colocated"]]
    assert max(row.get(f"staleness/{a}/max", 0) for row in runs["separate"] for a in AGENTS) == 1  # one step ahead

    with Coordinator(validate_config(_shared_host("separate")), tmp_path / "killed") as coord:
        run_killing(coord, coord.pool.start_info["b"]["rollout_engine"]["pid"], at_step=2)
        assert coord.restarts == 1
    assert without_times(rows(tmp_path / "killed")) == without_times(rows(tmp_path / "separate"))


@pytest.mark.fast
def test_a_shared_hosts_vllm_engine_is_sized_once_for_the_host():
    """The host's agents share one vLLM engine: its KV cache holds the rows of the largest of their generate calls,
    and the memory plan counts the base in it once, beside each agent's adapter."""
    from orchestrator.memory_plan import estimate

    raw = shared_host_config(roles={"r0": "a", "r1": "a", "r2": "b", "r3": "c"})
    raw["environment"]["kwargs"]["roles"] = ["r0", "r1", "r2", "r3"]
    for name in AGENTS:
        raw["agents"][name]["rollout"] = {"engine": "vllm"}
    cfg = validate_config(raw)
    rows_a = cfg.train.batch_size * cfg.train.num_generations * 2  # a holds two roles
    assert plan_of(cfg).engine_cache_sizes == dict.fromkeys(AGENTS, rows_a)
    sizes, base = estimate(cfg, dict.fromkeys(AGENTS, (1000, 10)))
    assert [sizes[a].engine for a in AGENTS] == [4000, 40, 40] and base == {"h": 4000}  # float32 on CPU
    raw["agents"]["b"]["rollout"] = {"engine": "hf"}
    with pytest.raises(ConfigError, match=r"agents\.b\.rollout\.engine: 'hf' differs from agents\.a\.rollout\.engine "
                                          r"'vllm', and both live on host 'h'"):
        validate_config(raw)
