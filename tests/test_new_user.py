"""A new user's path: validate catches what would fail later, paths and data load as expected, the
Python API of a custom loop."""

from __future__ import annotations

import json

import pytest

from orchestrator.coordinator import Coordinator
from protocols.config import ConfigError, load_config, validate_config
from tests.envs import HERE, config
from tests.inproc import marsi
from tests.runs import marsi as subprocess_marsi
from tests.runs import write

# ----------------------------------------------------------------------------------------- validate
def test_validate_catches_a_misspelt_role(tmp_path):
    raw = config(roles={"r0": "a", "r1": "b"})
    raw["roles"]["assignment"] = {"r0": "a", "r_1": "b"}
    out = marsi("validate", write(tmp_path, raw))
    assert out.returncode == 2
    assert "roles.assignment: role 'r_1' is not one of the environment's roles (r0, r1); fix the name" in out.stderr


def test_validate_catches_a_request_larger_than_the_local_cluster(tmp_path):
    raw = config(("a", "b", "c"), ray=True)
    for agent in raw["agents"].values():
        agent["resources"] = {"num_cpus": 1}
    raw["ray"]["num_cpus"] = 2
    out = subprocess_marsi("validate", write(tmp_path, raw))  # a process not connected to Ray: the local cluster
    assert out.returncode == 2
    assert ("agents ask for 3 CPUs in all (a: 1, b: 1, c: 1) but the local cluster has 2; lower "
            "agents.NAME.resources.num_cpus") in out.stderr


def test_validate_catches_a_model_context_too_short(tmp_path):
    raw = config()
    raw["agents"]["a"]["generation"] = {"max_prompt_length": 1020, "max_completion_length": 8}
    out = marsi("validate", write(tmp_path, raw))
    assert out.returncode == 2
    assert "agents.a: generation.max_prompt_length (1020) + max_completion_length (8) exceed the model's context " \
           "of 1024 tokens" in out.stderr


def test_validate_prints_every_turn_who_acts_and_counts_steps_from_one(tmp_path):
    raw = config(roles={"r0": "a", "r1": "b"}, turns=6, train={"steps": 3})
    raw["environment"]["kwargs"]["silent"] = ["r1"]
    raw["roles"]["rotation"] = "per_turn"
    out = marsi("validate", write(tmp_path, raw), "--steps", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "step 1: trains a, b" in lines and "step 2: trains a, b" in lines and "step 0" not in out.stdout
    episode = next(line for line in lines if line.strip().startswith("episode 1:"))
    assert episode.count("turn ") == 6 and "turn 6: r0=b* r1=a" in episode  # per-turn rotation, r1 never acts
    assert "turn 1: r0=a* r1=b |" in episode


def test_validate_says_when_no_agent_trains(tmp_path):
    raw = config(schedule={"frozen": ["a", "b"]})
    out = marsi("validate", write(tmp_path, raw))
    assert out.returncode == 0 and "no agent trains" in out.stdout


def test_validate_names_frozen_agents_and_their_unused_optimizer_settings(tmp_path):
    raw = config(("a", "b", "c"), schedule={"frozen": ["b"], "kind": "pattern", "pattern": [["a"]]})
    raw["agents"]["b"]["optimizer"] = {"lr": 0.5}
    out = marsi("validate", write(tmp_path, raw))
    assert out.returncode == 0, out.stderr
    assert ("frozen, never updated in this run: b, c; agents.b.optimizer, agents.c.optimizer set but unused"
            in out.stdout.splitlines())
    out = marsi("validate", write(tmp_path, config()))
    assert "never updated" not in out.stdout


def _proposer_solver(tmp_path, fault):
    """A config of tests/fixtures/number_relay.py, whose solver's turn parses model text with int()."""
    raw = config(("p", "s"), roles={"proposer": "p", "solver": "s"})
    raw["environment"] = {"name": f"{HERE / 'fixtures' / 'number_relay.py'}:NumberRelay", "kwargs": {"fault": fault}}
    raw["data"] = {"factory": f"{HERE / 'fixtures' / 'number_relay.py'}:make_dataset"}
    return write(tmp_path, raw)


@pytest.mark.parametrize("fault, case", [("nan", "validate_trial_nan_reward"), ("raise", "validate_trial_raises"),
                                         ("", "validate_check_env")])
def test_validate_plays_its_trial_episode_with_the_checks_of_a_run_and_of_check_env(fault, case, tmp_path):
    """A final reward that is not finite, an exception at turn 2 (named as a run names it: class, file:line, episode,
    turn), and int() on junk model text at turn 2, which only junk after a well-formed first turn reaches."""
    from tests.errors_doc import assert_documented

    out = marsi("validate", _proposer_solver(tmp_path, fault))
    assert out.returncode == 2 and out.stdout == "", out.stdout
    assert_documented(case, out.stderr, exit=out.returncode, tmp=tmp_path)


# ------------------------------------------------------------------------------------- paths and data
def test_relative_and_home_model_paths_resolve_against_the_config_file(tmp_path, monkeypatch):
    from agent_trainer.models import resolve_model_path

    (tmp_path / "cfg").mkdir()
    model_dir = tmp_path / "cfg" / "models" / "tiny"
    model_dir.parent.mkdir()
    model_dir.symlink_to(resolve_model_path("builtin:tiny"))
    monkeypatch.setenv("HOME", str(tmp_path))
    raw = config()
    raw["agents"]["a"]["model"] = "./models/tiny"
    raw["agents"]["b"]["model"] = "~/cfg/models/tiny"
    monkeypatch.chdir(tmp_path)  # elsewhere than the config file
    cfg = load_config(write(tmp_path / "cfg", raw))
    assert cfg.agents["a"].model == str(model_dir.resolve()) == cfg.agents["b"].model


def test_a_hub_model_in_the_local_cache_validates_offline_and_one_missing_is_named(tmp_path):
    """Offline, a hub id is looked up in the local Hugging Face cache (HF_HOME): the tiny model's files put there
    as a download leaves them validate; another id gets the one line that names the agent, the model and the fix."""
    import shutil

    from agent_trainer.models import resolve_model_path

    snapshot = tmp_path / "hf" / "hub" / "models--marsi-test--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(resolve_model_path("builtin:tiny"), snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    raw = config()
    raw["agents"]["a"]["model"] = "marsi-test/tiny"
    offline = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    out = subprocess_marsi("validate", write(tmp_path, raw), env=offline)  # HF_HOME is read at import: a new process
    assert out.returncode == 0, out.stderr
    raw["agents"]["b"]["model"] = "marsi-test/other"
    out = subprocess_marsi("validate", write(tmp_path, raw), env=offline)
    assert out.returncode == 2 and out.stderr.startswith(
        f"marsi: error: {tmp_path}/run.yaml: agents.b.model: 'marsi-test/other' is not in the local Hugging Face "
        f"cache ({tmp_path}/hf/hub) and HF_HUB_OFFLINE is set"), out.stderr


def test_a_dataset_saved_with_save_to_disk_loads_through_data_path(tmp_path):
    import datasets

    from orchestrator.data import load_samples

    rows = [{"target": "a"}, {"target": "b"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "two"))
    for path, split, expected in (("one", "train", rows), ("two", "test", rows[:1])):
        raw = config()
        raw["data"] = {"path": path, "split": split}
        assert load_samples(load_config(write(tmp_path, raw)).data) == expected


def test_data_that_runs_out_is_said_and_counted(tmp_path, capfd):
    raw = config(train={"steps": 6, "batch_size": 3})  # 8 samples, 3 per step: steps 3 and 6 wrap
    with Coordinator(validate_config(raw)) as coord:
        history = coord.run()
    assert [round(m["data/epoch"], 3) for m in history] == [0.375, 0.75, 1.125, 1.5, 1.875, 2.25]
    assert capfd.readouterr().err.count("data: all 8 samples used; going round again (reshuffled each epoch)") == 1


def test_data_used_up_exactly_is_said_only_when_a_sample_comes_round_again(capfd):
    raw = config(train={"steps": 3, "batch_size": 4})  # 8 samples, 4 per step: steps 1 and 2 use each once
    with Coordinator(validate_config(raw)) as coord:
        history = coord.run(until=2)
        assert [m["data/epoch"] for m in history] == [0.5, 1.0]
        assert "going round again" not in capfd.readouterr().err
        coord.run()  # step 3 uses the first samples again
    assert capfd.readouterr().err.count("data: all 8 samples used; going round again") == 1


def test_a_run_that_fails_before_its_first_step_leaves_no_directory(tmp_path):
    raw = config()
    raw["environment"]["name"] = f"{HERE / 'envs.py'}:BrokenEnv"
    raw["environment"]["kwargs"].update(fail="step", token="first-step")
    out = marsi("run", write(tmp_path, raw), "--run-dir", tmp_path / "run")
    assert out.returncode == 2 and "BrokenEnv.step raised ZeroDivisionError" in out.stderr
    assert not (tmp_path / "run").exists()


def test_the_run_directory_keeps_the_environment_source(tmp_path):
    out = marsi("run", write(tmp_path, config(train={"steps": 1})), "--run-dir", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "source" / "envs.py").read_text() == (HERE / "envs.py").read_text()


# ------------------------------------------------------------------------------------ the chat template
@pytest.mark.slow
def test_a_prompt_already_templated_is_not_templated_again(capfd):
    from agent_trainer.trainer import AgentTrainer
    from protocols.config import AgentConfig, AlgorithmConfig

    trainer = AgentTrainer("a", AgentConfig(model="builtin:smollm2-135m-instruct"), AlgorithmConfig())
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids, _ = trainer.encode_prompt(chatml)
    assert ids == trainer.tokenizer(chatml, add_special_tokens=False).input_ids
    assert trainer.tokenizer.decode(ids).count("<|im_start|>system") == 1
    trainer.encode_prompt(chatml)
    assert capfd.readouterr().err.count("already opens with the chat template's '<|im_start|>'") == 1
    plain, _ = trainer.encode_prompt("What is 2+2?")
    assert trainer.tokenizer.decode(plain).startswith("<|im_start|>system")  # plain text is still templated


# --------------------------------------------------------------------------------------- Python API
def test_the_custom_loop_api_refuses_what_would_corrupt_a_run(tmp_path):
    raw = config(("a", "b", "judge"), schedule={"frozen": ["judge"]})
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        assert coord.step == 0 and coord.restored_from is None
        with pytest.raises(ConfigError, match=r"generate: agent 'zed' is not defined; defined agents: a, b, judge"):
            coord.generate({"zed": ["Say a"]}, seed=0)
        out = coord.generate({"judge": ["Say a"]}, seed=0)
        from protocols.messages import Experience

        with pytest.raises(ConfigError, match=r"train: agent 'judge' is frozen \(schedule.frozen\)"):
            coord.train({"judge": [Experience.from_completion(out["judge"][0], 1.0)]})
        coord.loop_state["note"] = [1, 2]
        coord.checkpoint(step=1)
        with pytest.raises(ConfigError, match=r"checkpoint\(\): step-000001 exists; pass the step your loop reached"):
            coord.checkpoint()
        with pytest.raises(ConfigError, match=r"checkpoint\(step=0\): the newest checkpoint is step-000001"):
            coord.checkpoint(step=0)
        coord.loop_state["bad"] = object()
        with pytest.raises(ConfigError, match=r"loop_state must hold JSON values only"):
            coord.checkpoint(step=2)
    with Coordinator.resume(tmp_path / "run") as coord:
        assert coord.step == 1 and coord.restored_from.name == "step-000001"
        assert coord.loop_state == {"note": [1, 2]}


def test_help_shows_each_fields_docstring():
    import pydoc

    from protocols.config import AgentConfig
    from protocols.messages import Experience

    assert "micro_batch_size: Sequences per forward/backward in an update" in pydoc.render_doc(AgentConfig)
    assert "advantage: Scalar advantage given to every token" in pydoc.render_doc(Experience)
    json.dumps(AgentConfig.model_json_schema())  # the schema stays serialisable
