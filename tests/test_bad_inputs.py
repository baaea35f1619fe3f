"""Bad input gets one line naming the file, key, agent or episode and the fix, and a non-zero exit.

The table here is the main one of docs/errors.md; tests/errors_doc.py compares each message with its row, whole.
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from orchestrator.cli import main
from orchestrator.runlog import RunLog, checkpoint_problem
from tests import errors_doc
from tests.envs import HERE, config
from tests.errors_doc import assert_documented

ENVS = HERE / "envs.py"


def cfg(tmp_path, edit=None, text=None):
    """Write a run config (the tiny two-agent one, in-process trainers) changed by `edit(raw)`."""
    raw = config(train={"steps": 2})
    if edit:
        edit(raw)
    path = tmp_path / "run.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text if text is not None else yaml.safe_dump(raw))
    return path


def setter(dotted, value):
    def edit(raw):
        *parents, last = dotted.split(".")
        node = raw
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return edit


def broken_env(fail, after=0):
    def edit(raw):
        raw["environment"]["name"] = f"{ENVS}:BrokenEnv"
        raw["environment"]["kwargs"].update(fail=fail, after=after, token=f"{fail}-{after}-{id(raw)}")
    return edit


def faulty_env(fault):
    def edit(raw):
        raw["environment"]["name"] = f"{ENVS}:FaultyEnv"
        raw["environment"]["kwargs"]["fault"] = fault
    return edit


def _alias_bomb() -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    return "\n".join(lines) + "\n"


def run(edit=None, *extra, text=None):
    return lambda tmp_path: ["run", str(cfg(tmp_path, edit, text)), *extra, "--run-dir", str(tmp_path / "out")]


CASES = {
    "malformed_yaml": (run(text="agents: {a: [\n"), "malformed YAML"),
    "not_a_mapping": (run(text="- a\n- b\n"), "expected a mapping of sections"),
    "unknown_key": (run(setter("train.stepz", 3)), "train.stepz: unknown key; allowed keys here: steps"),
    "wrong_type": (run(setter("train.steps", "many")), "train.steps: Input should be a valid integer"),
    "out_of_range": (run(setter("algorithm.discount", 2)), "algorithm.discount: Input should be less than or equal to 1"),
    "missing_section": (run(lambda raw: raw.pop("roles")), "roles: missing; this key is required"),
    "config_file_missing": (lambda tmp_path: ["run", str(tmp_path / "nope.yaml")], "cannot read config"),
    "module_missing": (run(setter("environment.name", "no_such_pkg.envs:Env")), "cannot import module 'no_such_pkg.envs'"),
    "env_file_missing": (run(setter("environment.name", "missing.py:Env")), "environment.name: file"),
    "attribute_missing": (run(setter("environment.name", f"{ENVS}:Nope")), "has no attribute 'Nope'"),
    "data_file_missing": (run(lambda raw: raw.update(data={"path": "nope.jsonl"})), "data.path: file"),
    "data_factory_raises": (run(setter("data.factory", f"{ENVS}:raising_factory")),
                            "data.factory: loading the data raised FileNotFoundError"),
    "empty_dataset": (run(setter("data.factory", f"{ENVS}:empty")), "data.factory: the dataset is empty"),
    "role_names_unknown_agent": (run(setter("roles.assignment", {"r0": "a", "r1": "zed"})),
                                 "roles.assignment: agent 'zed' is not defined"),
    "schedule_names_unknown_agent": (run(setter("schedule.frozen", ["zed"])), "schedule.frozen: agent 'zed'"),
    "one_generation_per_group": (run(setter("train.num_generations", 1)), "set train.num_generations >= 2"),
    "rotation_leaves_groups_of_one": (run(setter("roles.rotation", "per_episode")),
                                      "each (agent, role) group of a sample gets num_generations / 2 episodes"),
    "critic_without_its_baseline": (run(setter("critic", {"kind": "central"})),
                                    "critic: given, but algorithm.baseline is 'group'"),
    "critic_head_on_an_agent_elsewhere": (run(lambda raw: raw.update(algorithm={"baseline": "critic"},
                                                                     critic={"model": "agent"})),
                                          "critic.model: agent puts a value head on an agent's own model"),
    "critic_with_asynchronous_rollouts": (run(lambda raw: raw.update(algorithm={"baseline": "critic"}), "train.max_staleness=1"),
                                          "train.max_staleness: 1 with algorithm.baseline: critic"),
    "bad_override": (run(None, "train.steps"), "expected dotted.key=value"),
    "model_path_missing": (run(setter("agents.a.model", "/no/such/model")),
                           "agents.a.model: '/no/such/model' not found; give an existing directory"),
    "unknown_builtin": (run(setter("agents.b.model", "builtin:huge")), "unknown built-in model 'builtin:huge'"),
    "prompt_longer_than_context": (run(setter("agents.a.generation", {"max_prompt_length": 1020,
                                                                      "max_completion_length": 8})),
                                   "exceed the model's context of 1024 tokens; lower them"),
    "vllm_settings_for_hf_engine": (run(setter("agents.a.rollout", {"vllm": {"max_num_seqs": 8}})),
                                    "agents.a.rollout.vllm: vLLM settings are given but agents.a.rollout.engine is 'hf'"),
    "sleep_mode_without_gpu": (run(setter("agents.b.rollout", {"engine": "vllm", "vllm": {"sleep_mode": True}})),
                               "agents.b.rollout.vllm.sleep_mode: true frees GPU memory during updates"),
    "staleness_bound_above_the_runs": (run(setter("agents.b.rollout", {"max_staleness": 1})),
                                       "agents.b.rollout.max_staleness: 1 is above train.max_staleness 0"),
    "separate_engine_without_ray": (run(setter("agents.a.rollout", {"placement": "separate"})),
                                    "agents.a.rollout.placement: separate runs the engine in a process of its own"),
    "weight_transfer_without_separate_engine": (run(setter("agents.a.rollout", {"weight_transfer": "store"})),
                                                "agents.a.rollout.weight_transfer: store is how an engine of its own"),
    "nice_without_separate_engine": (run(setter("agents.a.rollout", {"nice": 5})),
                                     "agents.a.rollout.nice: 5 is the niceness of an engine of its own"),
    "env_raises_in_reset": (run(broken_env("reset")), "episode 1 turn 1: BrokenEnv.reset raised KeyError: 'target' "
                                                      "at tests/envs.py:95;"),
    "env_raises_in_step": (run(broken_env("step")), "episode 1 turn 1: BrokenEnv.step raised ZeroDivisionError: "
                                                    "division by zero at tests/envs.py:101; fix the environment "
                                                    "(check it with check_env; --debug shows the traceback)"),
    "role_not_in_environment": (run(setter("environment.kwargs", {"roles": ["r0", "r9"]})),
                                "roles.assignment: role 'r1' is not one of the environment's roles (r0, r9)"),
    "environment_role_unseated": (run(setter("environment.kwargs", {"roles": ["r0", "r1", "r2"]})),
                                  "roles.assignment: the environment's role 'r2' has no seat"),
    "nan_reward": (run(broken_env("nan")), "reward nan is not finite"),
    "env_constructor_raises": (run(faulty_env("constructor")), "envs.py:FaultyEnv: constructing it with "
                               "environment.kwargs raised TypeError: FaultyEnv() got an unexpected keyword argument "
                               "'levels' at tests/envs.py:120"),
    "env_max_turns_none": (run(faulty_env("max_turns_none")), "FaultyEnv: max_turns must be a positive int"),
    "env_reset_returns_none": (run(faulty_env("reset_none")), "FaultyEnv.reset: prompts must be a dict"),
    "env_step_returns_none": (run(faulty_env("step_none")), "FaultyEnv.step: must return a StepResult, got NoneType"),
    "env_step_returns_dict": (run(faulty_env("step_dict")), "FaultyEnv.step: must return a StepResult, got dict"),
    "env_huge_reward": (run(faulty_env("huge_reward")), "reward 1e+308 is beyond +-1e+12"),
    "env_bytes_prompt": (run(faulty_env("bytes_prompt")), "prompt of 'r0' must be a str or a list of chat messages"),
    "env_surrogate_prompt": (run(faulty_env("surrogate_prompt")), "prompt of 'r0' is not valid text"),
    "env_info_not_numbers": (run(faulty_env("info_text")), "episode_info['hits'] must be a finite number"),
    "yaml_duplicate_key": (run(text="train: {steps: 2}\ntrain: {seed: 1}\n"), "duplicate key 'train'"),
    "yaml_not_utf8": (run(text=b"train: {steps: 2}\n# caf\xe9\n"), "not UTF-8 text (byte 0xe9 at offset 23)"),
    "yaml_alias_bomb": (run(text=_alias_bomb()), "expands to more than 100,000 values through YAML aliases"),
    "infinite_reward": (run(broken_env("inf")), "reward inf is not finite"),
    "storage_bad_scheme": (run(setter("train.storage", "ftp://host/x")), "train.storage: scheme 'ftp' of 'ftp://host/x'"),
    "resume_without_checkpoint": (lambda tmp_path: ["resume", str(_run_dir_without_checkpoint(tmp_path))],
                                  "no complete checkpoint to resume from"),
    "resume_missing_dir": (lambda tmp_path: ["resume", str(tmp_path / "nope")], "cannot read config"),
    "plot_without_metrics": (lambda tmp_path: ["plot", str(tmp_path)], "no metrics.jsonl rows to plot"),
    "tensorboard_missing": (run(setter("logging.tensorboard", True)), "logging.tensorboard needs TensorBoard, which is "
                            "not installed; install it with: pip install tensorboard", ("tensorboard",)),
    "wandb_missing": (run(setter("logging.wandb_project", "p")), "logging.wandb_project needs Weights & Biases, which "
                      "is not installed; install it with: pip install wandb", ("wandb",)),
    "eval_overlaps_training": (lambda tmp_path: ["run", str(cfg(tmp_path, _evaluating_training_data(tmp_path)))],
                               "eval.data: 8 of its 8 samples are training samples too"),
    "compare_one_checkpoint": (lambda tmp_path: ["eval", str(tmp_path), "--compare", "initial"],
                               "marsi eval: argument --compare: expected 2 arguments; see marsi eval --help"),
    "compare_unknown_metric": (lambda tmp_path: ["eval", str(_run_dir_without_checkpoint(tmp_path, evaluating=True)),
                                                 "--compare", "initial", "last", "--metric", "episode/nope"],
                               "--metric episode/nope: the environment's episode_info has no 'nope'; give one of "
                               "reward/mean, episode/hits, episode/success"),
    "export_out_unwritable": (lambda tmp_path: ["export", str(_run_dir_without_checkpoint(tmp_path)), "--agent", "a",
                                                "--out", "/proc/x"],
                              "--out /proc/x: cannot create or write this directory (No such file or directory); "
                              "give one where you can write"),
    "resume_with_other_storage": (lambda tmp_path: ["resume", str(_finished_run(tmp_path)),
                                                    f"train.storage=file://{tmp_path}/store"],
                                  "a resumed run keeps its checkpoint storage (the run directory, "),
}


def _evaluating_training_data(tmp_path):
    """A config whose run directory comes from train.run_dir and whose evaluation set is its training set."""
    def edit(raw):
        raw["train"]["run_dir"] = str(tmp_path / "runs" / "{name}")
        raw["eval"] = {"data": raw["data"]}
    return edit


def _run_dir_without_checkpoint(tmp_path, evaluating=False):
    run_dir = tmp_path / "bare"
    run_dir.mkdir()
    raw = config()
    if evaluating:
        raw["eval"] = {"data": {"factory": f"{ENVS}:held_out"}}
        (run_dir / "metrics.jsonl").write_text("")  # a run that has begun (marsi eval reads run directories only)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw))
    return run_dir


def _finished_run(tmp_path):
    assert main(["run", str(cfg(tmp_path)), "--run-dir", str(tmp_path / "done")]) == 0
    return tmp_path / "done"


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_gets_one_clear_line(case, tmp_path, capsys, monkeypatch):
    make_argv, expected, *missing = CASES[case]
    for module in missing[0] if missing else ():
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    argv = make_argv(tmp_path)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("marsi: error: "), err
    assert expected in err and "Traceback" not in err
    assert_documented(case, err, exit=code, tmp=tmp_path)
    if argv[0] == "run":  # a run that failed to start leaves no directory
        assert not (tmp_path / "out").exists() and not any((tmp_path / "runs").glob("*")), case


def test_an_environment_failure_leaves_the_last_checkpoint_intact(tmp_path, capsys):
    argv = run(broken_env("step", after=4), "train.checkpoint_every=1")(tmp_path)  # 4 episodes per step
    assert main(argv) == 2
    assert "episode 5 turn 1: BrokenEnv.step raised ZeroDivisionError" in capsys.readouterr().err
    last = RunLog(tmp_path / "out").latest_checkpoint()
    assert last.name == "step-000001" and checkpoint_problem(last) is None
    assert [json.loads(line)["step"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()] == [1]


def test_the_docs_table_lists_every_case():
    main_table = {case for case, (_, _, row) in errors_doc.rows().items() if row.count(" | ") == 1}
    assert main_table == set(CASES)


def test_every_documented_error_is_checked_whole_by_a_test():
    """Each row of docs/errors.md is named by a test that compares marsi's message with it (assert_documented),
    or says in the row why it is checked only in part."""
    sources = "\n".join(p.read_text() for p in errors_doc.TESTS.glob("test_*.py"))
    unchecked = [case for case, (_, _, row) in errors_doc.rows().items()
                 if f'"{case}"' not in sources and "checked in part" not in row]
    assert unchecked == []


def test_numpy_rewards_are_accepted(tmp_path, capsys):
    assert main(run(faulty_env("numpy_reward"))(tmp_path)) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(isinstance(r["reward/mean"], float) for r in rows)


# ------------------------------------------------------------------------------- found before anything starts
# `marsi` in a fresh process, that would start a local Ray cluster (ray.enabled, no RAY_ADDRESS) in RAY_TMPDIR: each
# case is one line on stderr, nothing on stdout, exit 2, no Ray session, and the test's directory as it was. The cases
# run one after another in one process (tests/one_process.py), that process's Ray never started.

def _ray_cfg(tmp_path, edit=None, *, ray=True, name="run.yaml", evaluating=False):
    raw = config(ray=ray, train={"steps": 1})
    if evaluating:
        raw["eval"] = {"data": {"factory": f"{ENVS}:held_out"}}
    if edit:
        edit(raw)
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def _run_at(tmp_path, edit=None, **kwargs):
    return ["run", str(_ray_cfg(tmp_path, edit, **kwargs)), "--run-dir", str(tmp_path / "out")]


def _validate(tmp_path, edit=None, **kwargs):
    return ["validate", str(_ray_cfg(tmp_path, edit, **kwargs))]


def _example_dir(tmp_path):
    """A directory holding a config.yaml and nothing a run writes, as an example's directory does."""
    _ray_cfg(tmp_path, name="example/config.yaml", evaluating=True)
    return ["eval", str(tmp_path / "example")]


def _started_run(tmp_path):
    """A run directory of a run that has logged no checkpoint yet."""
    _ray_cfg(tmp_path, name="started/config.yaml", evaluating=True)
    (tmp_path / "started" / "metrics.jsonl").write_text("")
    return ["eval", str(tmp_path / "started")]


def _empty_dir(tmp_path):
    (tmp_path / "empty").mkdir()
    return ["eval", str(tmp_path / "empty")]


def _scripted_partner_without_player(raw):
    """An evaluation that seats the environment's scripted player, in an environment that has none."""
    ok = HERE / "fixtures" / "env_ok.py"
    raw.update(environment={"name": f"{ok}:OkEnv", "kwargs": {}}, roles={"assignment": {"speaker": "a", "listener": "b"}},
               data={"factory": f"{ok}:make_dataset"})
    raw["eval"] = {"data": {"factory": f"{ok}:make_dataset", "kwargs": {"n": 3}}, "partners": {"alone": {"b": "scripted"}}}


def _other_run(tmp_path):
    """Another run's directory, holding train.storage of the next run."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.yaml").write_text("{}\n")
    (tmp_path / "old" / "metrics.jsonl").write_text("")
    return setter("train.storage", str(tmp_path / "old" / "store"))


def _forward(*names):
    return setter("ray.forward_env", list(names))


BEFORE_START = [  # (id, docs/errors.md case, argv, environment variables set (None: removed)[, the row's words])
    ("eval_empty_dir", "eval_not_a_run_dir", _empty_dir, {}),
    ("eval_example_dir", "eval_config_dir", _example_dir, {}),
    ("eval_started_run", "eval_without_checkpoint", _started_run, {}),
    ("run_env_kwarg", "env_kwarg_unknown", lambda t: _run_at(t, setter("environment.kwargs.rolez", 1)), {}),
    ("validate_env_kwarg", "env_kwarg_unknown", lambda t: _validate(t, setter("environment.kwargs.rolez", 1)), {}),
    ("run_eval_env_kwarg", "eval_env_kwarg_unknown", lambda t: _run_at(
        t, setter("eval.environment_kwargs", {"turnz": 2}), evaluating=True), {}),
    ("run_scripted_partner", "partner_scripted_without_player", lambda t: _run_at(t, _scripted_partner_without_player),
     {}),
    ("run_critic_model", "critic_model_missing", lambda t: _run_at(
        t, lambda raw: raw.update(algorithm={"baseline": "critic"}, critic={"model": "/no/such/critic"})), {}),
    ("run_hub_model", "hub_model_not_cached", lambda t: _run_at(t, setter("agents.a.model", "marsi-test/not-cached")),
     {"HF_HUB_OFFLINE": "1"}),
    ("validate_hub_model", "hub_model_not_cached", lambda t: _validate(
        t, setter("agents.a.model", "marsi-test/not-cached")), {"HF_HUB_OFFLINE": "1"}),
    ("run_forward_unset", "forward_env_unset", lambda t: _run_at(t, _forward("MARSI_TEST_UNSET")),
     {"MARSI_TEST_UNSET": None}),
    ("validate_forward_unset", "forward_env_unset", lambda t: _validate(t, _forward("MARSI_TEST_UNSET")),
     {"MARSI_TEST_UNSET": None}),
    ("validate_forward_unset_without_ray", "forward_env_unset", lambda t: _validate(
        t, _forward("MARSI_TEST_UNSET"), ray=False), {"MARSI_TEST_UNSET": None}),
    ("validate_forward_empty", "forward_env_empty", lambda t: _validate(t, _forward("MARSI_TEST_EMPTY")),
     {"MARSI_TEST_EMPTY": ""}),
    ("run_forward_value", "forward_env_with_value", lambda t: _run_at(t, _forward("MARSI_TEST=hunter2")), {}),
    ("validate_forward_value_without_ray", "forward_env_with_value", lambda t: _validate(
        t, _forward("MARSI_TEST=hunter2"), ray=False), {}),
    ("run_custom_resource", "local_resource_missing", lambda t: _run_at(
        t, setter("agents.a.resources.custom", {"marsi_test": 1})), {}),
    ("validate_custom_resource", "local_resource_missing", lambda t: _validate(
        t, setter("agents.a.resources.custom", {"marsi_test": 1})), {}),
    ("run_accelerator_type", "local_accelerator_missing", lambda t: _run_at(
        t, setter("agents.a.resources.accelerator_type", "MARSI-X1")), {}),
    ("run_label_selector", "local_label_missing", lambda t: _run_at(
        t, setter("agents.a.resources.label_selector", {"zone": "marsi-test"})), {}),
    ("run_storage_in_run_dir", "storage_in_run_dir", lambda t: _run_at(
        t, setter("train.storage", str(t / "out" / "store"))), {}, {"STORE": "<tmp>/out/store", "PLACE": "<tmp>/out/store/out"}),
    ("run_storage_beside_run_dir", "storage_in_run_dir", lambda t: _run_at(t, setter("train.storage", str(t))), {},
     {"STORE": "<tmp>", "PLACE": "<tmp>/out"}),
    ("run_storage_in_other_run", "storage_in_other_run", lambda t: _run_at(t, _other_run(t)), {},
     {"PLACE": "<tmp>/old/store/out"}),
    ("validate_storage_in_other_run", "storage_in_other_run", lambda t: _validate(t, _other_run(t)), {},
     {"PLACE": "<tmp>/old/store/run-{time}"}),  # the run directory train.run_dir names, {time} left as it is
]


def _files(root):
    return sorted((str(p.relative_to(root)), p.is_file() and p.read_bytes()) for p in root.rglob("*")
                  if "__pycache__" not in p.parts)


OWN_PROCESS = {"run_hub_model", "validate_hub_model"}
"""Cases that need a process of their own: huggingface_hub reads HF_HOME (the cache named in the message) once, when
it is imported. The others share one fresh process (tests/one_process.py), one case after another."""


@pytest.fixture(scope="module")
def before_start(tmp_path_factory):
    """name -> (the case's directory, its files before marsi ran, marsi's result): each case in a fresh process that has
    started no Ray, with RAY_TMPDIR in the case's directory, RAY_ADDRESS unset and HF_HOME an empty place."""
    from tests.one_process import marsi_cases

    base = tmp_path_factory.mktemp("before-start")
    hf_home = base / "hf"
    prepared, groups = {}, {}
    for name, _, make_argv, variables, *_ in BEFORE_START:
        tmp_path = base / name
        tmp_path.mkdir()
        argv = make_argv(tmp_path)
        prepared[name] = (tmp_path, _files(tmp_path))
        env = {"RAY_TMPDIR": str(tmp_path / "ray"), "RAY_ADDRESS": None, **variables}
        process = {"HF_HOME": str(tmp_path / "hf")} if name in OWN_PROCESS else {"HF_HOME": str(hf_home)}
        groups.setdefault(name if name in OWN_PROCESS else "", []).append((name, {"argv": argv, "env": env}, process))
    done = {}
    for key, cases in groups.items():
        results = marsi_cases([case for _, case, _ in cases], base / f"cases-{key or 'shared'}", env=cases[0][2])
        done.update({name: result for (name, _, _), result in zip(cases, results)})
    assert not hf_home.exists()  # nothing was fetched or cached
    return {name: (*prepared[name], done[name]) for name in prepared}


@pytest.mark.parametrize("name, case, make_argv, variables, words", [(*c, {})[:5] for c in BEFORE_START],
                         ids=[c[0] for c in BEFORE_START])
def test_bad_input_fails_before_anything_starts(name, case, make_argv, variables, words, before_start):
    tmp_path, before, out = before_start[name]
    values = {k: v.replace("<tmp>", str(tmp_path)) for k, v in words.items()}
    assert out["returncode"] == 2, out["stderr"]
    assert out["stderr"].count("\n") == 1 and out["stdout"] == "", (out["stdout"], out["stderr"])
    assert_documented(case, out["stderr"], exit=out["returncode"], tmp=tmp_path, **values)
    assert "hunter2" not in out["stderr"]  # a value written into ray.forward_env by mistake is not echoed
    assert not out["ray_initialized"] and not (tmp_path / "ray").exists()  # no Ray session was started
    assert _files(tmp_path) == before and not (tmp_path / "out").exists()
