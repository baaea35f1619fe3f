"""examples/coop_coding: the cooperative HumanEval environment, its rewards through the real sandbox, and
one tiny run through the Coordinator with Ray real."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from orchestrator.coordinator import Coordinator
from protocols.config import load_config
from protocols.env_checker import check_env
from protocols.imports import import_object
from tests.hosts import run_as, user_namespaces_work

HERE = Path(__file__).resolve().parent.parent / "examples" / "coop_coding"
CONFIG = HERE / "config.yaml"
_env = lambda name: import_object(f"{HERE / 'env.py'}:{name}")  # noqa: E731


@pytest.fixture(scope="module")
def problems():
    return {row["task_id"]: row for row in _env("make_dataset")().to_list()}


@pytest.fixture
def env():
    # generous: a sandboxed interpreter can take seconds to start on a loaded 2-core machine, and a timeout here
    # would read as failing tests (the timeout itself has its own test, with 2 s)
    return _env("CoopCodingEnv")(timeout_s=30.0)


HELPER = '''Here is the helper:
```python
def aux(a: float, b: float, threshold: float) -> bool:
    return abs(a - b) < threshold
```
'''
MAIN = '''```python
from typing import List

def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if aux(a, b, threshold):
                return True
    return False
```
This loops over all pairs.'''
MAIN_ALONE = MAIN.replace("aux(a, b, threshold)", "abs(a - b) < threshold")


def play(env, sample, helper: str, main: str):
    prompts = env.reset(sample, seed=0)
    assert set(prompts) == {"helper"} and "has_close_elements" in prompts["helper"]
    first = env.step({"helper": helper})
    assert first.reward == 0.0 and set(first.prompts) == {"main"} and not first.terminated
    last = env.step({"main": main})
    assert last.terminated and not last.prompts
    return first, last, env.episode_info()


def test_dataset_splits_and_check_env(problems):
    make = _env("make_dataset")
    assert (len(problems), len(make(split="train")), len(make(split="test"))) == (164, 131, 33)
    assert all(len(r["prompt"]) <= 400 for r in make(split="train", max_prompt_chars=400))
    samples = make(split="test", limit=8).to_list()
    assert samples[1]["task_id"] == "HumanEval/5"
    check_env(_env("CoopCodingEnv")(), samples, action_fn=_env("sample_action"))
    check_env(_env("CoopCodingEnv")(), samples, action_fn=lambda role, prompt, rng: rng.choice("abcd"))


def test_correct_helper_and_main_get_the_full_reward(env, problems):
    first, last, info = play(env, problems["HumanEval/0"], HELPER, MAIN)
    assert "aux(a" in first.prompts["main"]  # the main agent sees the helper's code
    assert last.reward == pytest.approx(1.0)
    assert info == {"parses": 1.0, "defines_names": 1.0, "uses_helper": 1.0, "pass_rate": 1.0,
                    "all_passed": 1.0, "sandbox_error": 0.0}
    assert last.infos["main"] == {"passed": 7, "total": 7}


def test_main_not_using_the_helper_loses_the_helper_level(env, problems):
    _, last, info = play(env, problems["HumanEval/0"], HELPER, MAIN_ALONE)
    assert last.reward == pytest.approx(0.8) and info["uses_helper"] == 0.0 and info["pass_rate"] == 1.0
    assert "does not use aux" in last.infos["main"]["reason"] and not last.infos["main"].get("invalid")
    # redefining aux in the main code does not count as using the helper either
    own_aux = MAIN.replace("```\nThis", "\ndef aux(a, b, t):\n    return abs(a - b) < t\n```\nThis")
    _, last, info = play(env, problems["HumanEval/0"], HELPER, own_aux)
    assert last.reward == pytest.approx(0.8) and "redefines aux" in last.infos["main"]["reason"]
    rebound = MAIN.replace("from typing import List", "from typing import List\naux = lambda a, b, t: True")
    _, last, info = play(env, problems["HumanEval/0"], HELPER, rebound)
    assert info["uses_helper"] == 0.0 and "redefines aux" in last.infos["main"]["reason"]


def test_wrong_code_gets_a_partial_test_level(env, problems):
    wrong = MAIN.replace("return True\n    return False", "return False\n    return False")
    _, last, info = play(env, problems["HumanEval/0"], HELPER, wrong)
    assert info["pass_rate"] == pytest.approx(3 / 7) and info["all_passed"] == 0.0
    assert last.reward == pytest.approx(0.4 + 0.6 * 3 / 7)


def test_syntax_error_gets_zero_with_a_reason(env, problems):
    first, last, info = play(env, problems["HumanEval/0"], "def aux(a, b:\n    return a", MAIN)
    assert first.infos["helper"]["invalid"] and "syntax error" in first.infos["helper"]["reason"]
    assert last.reward == 0.0 and last.infos["main"]["invalid"]
    assert "does not parse (helper: syntax error" in last.infos["main"]["reason"] and info["parses"] == 0.0
    _, last, _ = play(env, problems["HumanEval/0"], HELPER, "def has_close_elements(numbers, threshold)\n    pass")
    assert last.reward == 0.0 and "does not parse (main: syntax error" in last.infos["main"]["reason"]


def test_infinite_loop_times_out_and_the_episode_goes_on(problems):
    env = _env("CoopCodingEnv")(timeout_s=2.0)
    loop = MAIN.replace("    for i, a", "    while True:\n        pass\n    for i, a")
    _, last, info = play(env, problems["HumanEval/0"], HELPER, loop)
    assert last.infos["main"] == {"invalid": True, "reason": "sandbox: timeout after 2.0s"}
    assert last.reward == pytest.approx(0.4)  # parses, names, uses aux; no test level
    assert info["sandbox_error"] == 1.0 and info["pass_rate"] == 0.0
    _, last, _ = play(env, problems["HumanEval/0"], HELPER, MAIN)  # the same env plays on
    assert last.reward == pytest.approx(1.0)


def test_printing_a_fake_report_scores_nothing(env, problems):
    fake = ('import os\nos.write(1, b\'\\n{"passed": 99, "failed": 0, "aborted": ""}\\n\')\n'
            'def has_close_elements(numbers, threshold):\n    return aux(0, 0, 0)\n')
    _, last, info = play(env, problems["HumanEval/0"], HELPER, fake)
    assert info["pass_rate"] < 1.0 and last.infos["main"]["total"] == 7


def test_hostile_code_is_contained(env, problems, tmp_path):
    outside = [tmp_path, Path(tempfile.mkdtemp(prefix=".sentinel-", dir=HERE))]  # hidden /tmp, and a visible dir
    try:
        for d in outside:
            (d / "keep.txt").write_text("keep")
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        attack = f'''
import os, shutil, socket, subprocess
def _attack():  # how many attempts failed
    failed = 0
    for d in {[str(d) for d in outside]!r}:
        for hit in (lambda: shutil.rmtree(d), lambda: os.remove(d + "/keep.txt"),
                    lambda: open(d + "/keep.txt", "w").write("gone"), lambda: open(d + "/new.txt", "w"),
                    lambda: os.system("rm -rf " + d), lambda: subprocess.run(["rm", "-rf", d])):
            try:
                hit()
            except BaseException:
                failed += 1
    try:
        socket.create_connection(("127.0.0.1", {port}), timeout=0.5).sendall(b"hi")
    except BaseException:
        failed += 1
    return failed
_attack()
'''
        hostile = MAIN.replace("```python\n", "```python\n" + attack).replace(
            "    for i, a", "    if _attack() != 13:\n        return None\n    for i, a")
        _, last, info = play(env, problems["HumanEval/0"], HELPER, hostile)
        # the reward is computed as usual, and full: every one of the 13 attempts raised inside the sandbox
        assert last.reward == pytest.approx(1.0) and info["pass_rate"] == 1.0, last.infos
        for d in outside:
            assert sorted(p.name for p in d.iterdir()) == ["keep.txt"] and (d / "keep.txt").read_text() == "keep"
        with pytest.raises(BlockingIOError):
            listener.accept()
        listener.close()
    finally:
        shutil.rmtree(outside[1], ignore_errors=True)


# Plays one episode on a host whose user (not root) cannot create user namespaces: refused, then allowed.
_ON_A_WEAK_HOST = r'''
import json, sys
from orchestrator.sandbox import SandboxUnavailable
from protocols.imports import import_object
here, helper, main = json.loads(sys.stdin.read())
env_cls = import_object(here + "/env.py:CoopCodingEnv")
try:
    env_cls()
    print("made")
except SandboxUnavailable as exc:
    print("refused:", exc)
env = env_cls(timeout_s=2.0, allow_weak_sandbox=True)
env.reset(import_object(here + "/env.py:make_dataset")().to_list()[0])
env.step({"helper": helper})
print(env.step({"main": main}).reward)
'''


@pytest.mark.skipif(not user_namespaces_work(), reason="needs user namespaces to play a user who is not root")
def test_a_weak_sandbox_is_refused_unless_the_environment_allows_it():
    done = run_as(_ON_A_WEAK_HOST, uid=1000, no_namespaces=("user",), stdin=json.dumps([str(HERE), HELPER, MAIN]))
    assert done.returncode == 0, done.stderr
    refused, reward = done.stdout.splitlines()
    assert refused.startswith("refused: sandbox: cannot contain model code: user namespaces are unavailable")
    assert reward == "1.0"  # allowed: the tests ran and all passed
    assert done.stderr.count("marsi: WARNING: sandbox: model code runs with WEAKER containment") == 1


@pytest.mark.skipif(not user_namespaces_work(), reason="needs user namespaces to play a user who is not root")
def test_a_weak_sandbox_stops_marsi_run_in_one_line(tmp_path):
    overrides = [f"agents.{a}.{key}" for a in ("helper", "main") for key in (
        "model=builtin:tiny", "generation.max_completion_length=8", "generation.max_prompt_length=256")]
    overrides += ["ray.enabled=false", "train.steps=1", "train.batch_size=1", "train.num_generations=2",
                  "train.progress=false"]
    argv = ["run", str(CONFIG), *overrides, "--run-dir", str(tmp_path / "out")]
    done = run_as(f"import sys\nfrom orchestrator.cli import main\nsys.exit(main({argv!r}))", uid=1000,
                  no_namespaces=("user",))
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("marsi: error: sandbox: cannot contain model code: user namespaces are unavailable"), last
    assert "Traceback" not in done.stderr


def test_tiny_run_through_the_coordinator(ray_cluster, tmp_path):
    agents = load_config(CONFIG).agents
    overrides = [f"agents.{a}.{key}" for a in agents for key in (
        "model=builtin:tiny", "generation.max_completion_length=8", "generation.max_prompt_length=256")]
    overrides += ["train.steps=1", "train.batch_size=1", "train.num_generations=2", "train.progress=false"]
    config = load_config(CONFIG, overrides)
    assert config.ray.enabled and config.roles.assignment == {"helper": "helper", "main": "main"}
    with Coordinator(config, tmp_path) as coord:
        history = coord.run()
    assert len(history) == 1 and history[0]["trained"] == ["helper", "main"]
    for key in ("parses", "defines_names", "uses_helper", "pass_rate", "all_passed"):
        assert f"episode/{key}" in history[0]
    assert history[0]["turns/mean"] == 2.0 and history[0]["tokens/helper"] > 0 and history[0]["tokens/main"] > 0
