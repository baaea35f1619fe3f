"""Asynchronous rollouts (train.max_staleness): the lag each schedule allows, which actions an update may use,
the policy versions actions carry, K = 0 as the synchronous loop, and exact resume with rollouts in flight."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from contextlib import nullcontext
from unittest import mock

import pytest

from orchestrator import pipeline
from orchestrator.coordinator import Coordinator
from orchestrator.rollout import Action, Episode, RecordedRoles, Turn
from orchestrator.runlog import RunLog, read_checkpoint_state
from orchestrator.schedule import Schedule
from orchestrator.step_loop import StepLoop
from orchestrator.steplog import computed
from orchestrator.staleness import rollout_lag, timing_metrics, usable_actions, weights_step
from protocols.config import ConfigError, ScheduleConfig, validate_config
from protocols.messages import Completion
from tests.envs import HERE, config
from tests.errors_doc import assert_quoted
from tests.runs import MARSI, killed_and_resumed, rows, run_killing, uninterrupted_rows, without_times, write


ENVS = HERE / "envs.py"
ROOT = HERE.parent


def lag(kind: str, agents=("a", "b"), k: int = 1, bounds=None, **schedule) -> int:
    s = Schedule(ScheduleConfig(kind=kind, **schedule), list(agents))
    return rollout_lag(s.training_agents, s.cycle, k, bounds)


@pytest.mark.fast
def test_the_lag_keeps_every_agent_within_k_versions_under_each_schedule():
    assert lag("simultaneous", k=0) == 0
    assert [lag("simultaneous", k=k) for k in (1, 2, 3)] == [1, 2, 3]
    assert [lag("alternate", k=k) for k in (1, 2)] == [2, 4]  # an agent's version moves every other step
    assert lag("alternate", k=1, period=2) == 1 and lag("alternate", k=2, period=2) == 4
    assert lag("round_robin", ("a", "b", "c"), k=1) == 3
    assert lag("pattern", k=1, pattern=[["a", "b"], ["a"]]) == 1  # a trains every step
    assert lag("pattern", k=1, pattern=[["a"], [], ["b"]]) == 3
    assert lag("simultaneous", ("a", "b"), k=2, frozen=["b"]) == 2  # a frozen agent's version never moves
    assert lag("simultaneous", ("a",), k=2, frozen=["a"]) == 2  # nobody trains: K steps, bounded all the same


@pytest.mark.fast
def test_an_agents_tighter_bound_lowers_the_lag_until_it_holds_at_every_update_of_that_agent():
    # simultaneous: b's partner a trains the step before each of b's updates, so only fresh rollouts keep b's K 0
    assert lag("simultaneous", k=1, bounds={"b": 0}) == 0 and lag("simultaneous", k=2, bounds={"b": 1}) == 1
    assert lag("alternate", k=2, bounds={"b": 1}) == 2  # a and b once each in the 2 steps before b trains
    assert lag("round_robin", ("a", "b", "c"), k=2, bounds={"b": 1}) == 3
    # a, idle, b: the step before b trains nobody does, so K_b = 0 still lets rollouts run one step ahead
    assert lag("pattern", k=1, bounds={"b": 0}, pattern=[["a"], [], ["b"]]) == 1
    assert lag("simultaneous", k=2, bounds={"b": 0}, frozen=["b"]) == 2  # a frozen agent's bound asks nothing
    assert lag("alternate", k=1, bounds={"a": 1, "b": 1}) == lag("alternate", k=1)  # bounds equal to K: as before


@pytest.mark.fast
def test_a_rollout_uses_the_weights_lag_steps_back_but_none_older_than_where_the_pipeline_started():
    assert [weights_step(r, 2, 0) for r in range(5)] == [0, 0, 0, 1, 2]
    assert [weights_step(r, 2, 3) for r in range(3, 7)] == [3, 3, 3, 4]


def _episode(index: int, versions: dict[str, int | None]) -> Episode:
    actions = [Action(role=f"r{i}", agent=agent, prompt="p",
                      completion=Completion(text="x", prompt_ids=[1], completion_ids=[2], per_token_logps=[-0.1],
                                            finish_reason="stop", policy_version=v))
               for i, (agent, v) in enumerate(versions.items())]
    return Episode(index=index, sample_index=0, env=RecordedRoles([a.role for a in actions]), turns=[Turn(actions, 1.0, {})])


@pytest.mark.fast
def test_an_update_drops_actions_staler_than_its_bound_its_own_or_a_partners():
    episodes = [_episode(0, {"a": 3, "b": 2}), _episode(1, {"a": 2, "b": 2}), _episode(2, {"a": 3, "<scripted>": None})]
    learners = {"a": 3, "b": 3}
    found = usable_actions(episodes, learners, {"a": 0, "b": 1})
    # a's bound is 0: episode 0 has a fresh but partner b one behind; episode 1 a is one behind; the scripted
    # player has no version and is never stale
    assert found.keep["a"] == [False, False, True]
    assert found.keep["b"] == [True, True]
    assert found.staleness["a"] == [0, 1, 0] and found.partners["a"] == 1 and found.partners["b"] == 1
    metrics = found.metrics(["a", "b"])
    assert metrics["staleness/a/dropped"] == pytest.approx(2 / 3) and metrics["staleness/a/dropped_actions"] == 2
    assert metrics["staleness/a/max"] == 1 and metrics["staleness/a/mean"] == pytest.approx(1 / 3)
    assert metrics["staleness/b/dropped"] == 0 and metrics["staleness/b/max"] == 1
    assert episodes[0].policy_versions() == {"a": 3, "b": 2}


@pytest.mark.fast
def test_overlap_and_idle_time_are_measured_from_the_calls():
    calls = [("a", "generate", 0.0, 4.0), ("b", "update", 2.0, 6.0), ("b", "generate", 7.0, 8.0)]
    out = timing_metrics(calls, (1.0, 9.0), ["a", "b"])
    assert out["time/overlap"] == pytest.approx(2.0)  # 2..4
    assert out["time/idle/a"] == pytest.approx(5.0) and out["time/idle/b"] == pytest.approx(3.0)


@pytest.mark.fast
def test_a_generate_still_under_way_at_the_steps_end_counts_in_that_steps_overlap():
    """A rollout played ahead often outlasts the update it overlaps: its generate is counted up to the step's
    end, and the rest of it in the next step's."""
    import threading

    from orchestrator.pipeline import AsyncRollouts

    pipe = object.__new__(AsyncRollouts)  # the timing alone: no source, no producer thread
    pipe.cond, pipe.agents = threading.Condition(), ["a", "b"]
    pipe.calls, pipe.running = [("a", "update", 2.0, 6.0)], {"b": 1.0}
    out = pipe.metrics((0.0, 8.0))
    assert out["time/overlap"] == pytest.approx(4.0) and out["time/generate"] == pytest.approx(7.0)
    assert out["time/idle/b"] == pytest.approx(1.0) and out["time/coordinator"] == pytest.approx(1.0)
    pipe.running = {}
    pipe.calls.append(("b", "generate", 1.0, 9.0))  # it ended in the next step
    assert pipe.metrics((8.0, 10.0))["time/generate"] == pytest.approx(1.0)


@pytest.mark.fast
def test_a_resume_with_a_shorter_lag_plays_again_the_rollouts_it_does_not_keep():
    records = [{"step": s, "data_before": {"epoch": 0, "index": s}, "episodes_before": 4 * s} for s in (5, 6, 7)]
    kept, replay = pipeline.kept_rollouts(records, 5, 2)
    assert [r["step"] for r in kept] == [5, 6] and replay["step"] == 7
    assert pipeline.kept_rollouts(records, 5, 3) == (records, None)


@pytest.mark.fast
def test_an_agents_bound_above_the_runs_is_refused():
    raw = config(train={"max_staleness": 1})
    raw["agents"]["b"]["rollout"] = {"max_staleness": 2}
    with pytest.raises(ConfigError, match=r"agents\.b\.rollout\.max_staleness: 2 is above train\.max_staleness 1, "
                                          r"which sets how far rollouts run ahead"):
        validate_config(raw)


# --------------------------------------------------------------------------------- on the tiny model
def _run(raw, run_dir=None, rollouts=None) -> list[dict]:
    made = mock.patch.object(StepLoop, "rollouts", lambda loop: rollouts(loop.coord)) if rollouts else nullcontext()
    with Coordinator(validate_config(raw), run_dir) as coord, made:
        return coord.run()


def test_k_zero_through_the_pipeline_gives_the_synchronous_loops_metrics_bit_for_bit():
    """The synchronous loop (K = 0) against the asynchronous pipeline held to lag 0: same episodes, same updates."""
    raw = config(turns=2, train={"steps": 3})
    sync = _run(raw)
    piped = _run(raw, rollouts=lambda coord: pipeline.AsyncRollouts(coord, 0))
    strip = lambda rows: [{k: v for k, v in computed(r).items() if not k.startswith("staleness/")} for r in rows]
    assert strip(piped) == strip(sync)
    assert all(r["staleness/a/max"] == 0 and r["staleness/b/partners_max"] == 0 for r in piped)
    assert not any(k.startswith("staleness/") for r in sync for k in r)  # K = 0 logs what it always did


@pytest.mark.parametrize("kind,expected", [("simultaneous", [0, 1, 1, 1]), ("alternate", [0, 0, 1, 1])])
def test_actions_are_at_most_k_versions_behind_and_the_planned_version_drew_them(kind, expected):
    """Every generate names the version planned for it and the trainer refuses another; staleness follows the
    schedule: one version behind from step 2 under simultaneous, from step 3 under alternate (lag 2)."""
    history = _run(config(turns=2, train={"steps": 4, "max_staleness": 1}, schedule={"kind": kind}))
    behind = [max(r[k] for k in r if k.startswith("staleness/") and k.endswith("/max")) for r in history]
    assert behind == expected
    assert all(r[k] == 0 for r in history for k in r if k.endswith("/dropped_actions"))
    assert all(r[k] <= 1 for r in history for k in r if k.endswith("/partners_max"))


def test_an_agent_with_a_tighter_bound_trains_at_each_of_its_steps_on_fresh_actions(capsys):
    """a, an idle step, b, with K = 1 and b's K 0: rollouts still run one step ahead (lag 1, not 3), and every
    update of b finds its own and its partner's actions fresh; nothing is dropped."""
    raw = config(turns=2, train={"steps": 6, "max_staleness": 1},
                 schedule={"kind": "pattern", "pattern": [["a"], [], ["b"]]})
    raw["agents"]["b"]["rollout"] = {"max_staleness": 0}
    with Coordinator(validate_config(raw)) as coord:
        assert coord.lag == 1
        history = coord.run()
        assert coord.state.versions == {"a": 2, "b": 2}
    assert [r["trained"] for r in history] == [["a"], [], ["b"], ["a"], [], ["b"]]
    assert all(r["staleness/b/max"] == 0 and r["staleness/b/partners_max"] == 0 for r in history if r["trained"] == ["b"])
    assert all(r[k] == 0 for r in history for k in r if k.endswith("/dropped_actions"))
    assert "keeps rollouts 1 step(s) ahead (train.max_staleness 1 alone plays them 3 step(s) ahead" in capsys.readouterr().err


def test_a_bound_that_no_lag_keeps_makes_rollouts_synchronous_and_its_agent_still_learns(capsys):
    """The demo with simultaneous updates, K = 1 and bob's K 0 (bob trained at step 1 and never again: versions
    alice 6, bob 1): every lag above 0 leaves alice one version ahead at bob's updates, so rollouts are synchronous,
    said once at run and by validate, and both agents train at every step."""
    from protocols.config import load_config

    probe = ["schedule.kind=simultaneous", "train.max_staleness=1", "agents.bob.rollout.max_staleness=0"]
    demo = ROOT / "examples" / "demo" / "config.yaml"
    cfg = load_config(demo, [*probe, "train.steps=6", "train.batch_size=2", "train.num_generations=4",
                             "ray.enabled=false", "train.progress=false", "eval=null"])
    with Coordinator(cfg) as coord:
        assert coord.lag == 0
        history = coord.run()
        assert coord.state.versions == {"alice": 6, "bob": 6}
    assert all(r["trained"] == ["alice", "bob"] for r in history)
    note = ("agents.bob.rollout.max_staleness 0 keeps rollouts synchronous (train.max_staleness 1 alone plays them 1 "
            "step(s) ahead under schedule simultaneous, where bob's own or its partners' actions would be more than 0 "
            "version(s) behind at its updates, which would then be skipped); raise agents.bob.rollout.max_staleness to "
            "1 to play 1 step(s) ahead, or set train.max_staleness: 0 to say so")
    err = capsys.readouterr().err
    assert err.count(note) == 1 and "was more than 0 policy versions behind" not in err
    assert_quoted(f"marsi: {note}")
    out = subprocess.run([*MARSI, "validate", str(demo), *probe, "--steps", "1"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and f"rollouts: {note}" in out.stdout, out.stderr


def async_config() -> dict:
    return config(turns=2, train={"steps": 4, "max_staleness": 1, "checkpoint_every": 1, "keep_checkpoints": 5})


@pytest.fixture(scope="module")
def async_whole(tmp_path_factory):
    """The directory of an uninterrupted in-process run of `async_config()` (K = 1), and its metrics."""
    run_dir = tmp_path_factory.mktemp("async-whole")
    return run_dir, uninterrupted_rows(validate_config(async_config()), run_dir)


def test_a_killed_async_run_resumes_to_the_uninterrupted_runs_metrics(tmp_path, async_whole):
    """K = 1: the checkpoint after step 2 holds the rollout of step 3, played with weights it no longer has; the
    coordinator is SIGKILLed, resumed, and ends with the metrics of a run never interrupted."""
    whole, uninterrupted = async_whole
    state = read_checkpoint_state(RunLog(whole).checkpoints()[2])
    assert state["step"] == 2 and [r["step"] for r in state["rollouts"]] == [2]
    assert state["versions"] == {"a": 2, "b": 2}
    assert {e["turns"][0]["actions"][0]["completion"]["policy_version"] for e in state["rollouts"][0]["episodes"]} == {1}
    import json

    transcripts = [json.loads(line) for line in (whole / "transcripts.jsonl").read_text().splitlines()]
    for t in transcripts:  # each episode names every agent's version, the one each of its actions carries
        acted = {a["agent"]: a["policy_version"] for turn in t["turns"] for a in turn["actions"]}
        assert t["policy_versions"] == acted == dict.fromkeys(("a", "b"), max(0, t["step"] - 2))

    assert killed_and_resumed(write(tmp_path, async_config()), tmp_path / "run", 4) == uninterrupted


@pytest.mark.parametrize("kind", ["simultaneous", "alternate"])
def test_a_finished_async_run_extended_ends_as_a_longer_uninterrupted_run(tmp_path, kind):
    """K = 1: a run of 3 steps plays the rollouts of steps 4 (and 5 under alternate, lag 2) with the weights an
    uninterrupted longer run would, and its last checkpoint keeps them; `marsi resume RUN train.steps=5` then
    continues into the metrics of a 5-step run (the in-flight rollouts were played again with newer weights)."""
    raw = config(turns=2, train={"steps": 5, "max_staleness": 1, "checkpoint_every": 1, "keep_checkpoints": 9},
                 schedule={"kind": kind})
    uninterrupted = uninterrupted_rows(validate_config(raw), tmp_path / "whole")
    raw["train"]["steps"] = 3
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        coord.run()
        lag = coord.lag
    state = read_checkpoint_state(RunLog(tmp_path / "run").latest_checkpoint())
    assert state["step"] == 3 and [r["step"] for r in state["rollouts"]] == list(range(3, 3 + lag))
    with Coordinator.resume(tmp_path / "run", ["train.steps=5"]) as coord:  # `marsi resume RUN train.steps=5`
        coord.run()
    assert without_times(rows(tmp_path / "run")) == uninterrupted


def test_an_async_run_whose_trainer_dies_restarts_and_ends_as_if_uninterrupted(ray_cluster, tmp_path, async_whole):
    _, uninterrupted = async_whole
    raw = async_config()
    raw["ray"]["enabled"] = True
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        victim = coord.pool.info()["b"]["pid"]
        run_killing(coord, victim, at_step=2)
        assert coord.restarts == 1
    assert without_times(rows(tmp_path / "run")) == uninterrupted


@pytest.mark.fast
def test_a_separate_engine_needs_ray_and_is_one_process():
    raw = config(train={"max_staleness": 1})
    raw["agents"]["a"]["rollout"] = {"placement": "separate"}
    with pytest.raises(ConfigError, match=r"agents\.a\.rollout\.placement: separate runs the engine in a process of "
                                          r"its own, which needs Ray, but ray\.enabled is false"):
        validate_config(raw)
    raw["ray"]["enabled"] = True
    raw["agents"]["a"]["rollout"] = {"placement": "separate", "engine": "vllm"}
    assert validate_config(raw).agents["a"].rollout.engine == "vllm"  # either engine
    raw["agents"]["a"]["resources"] = {"num_workers": 2}  # a data-parallel vLLM agent: its engine apart only
    assert validate_config(raw).agents["a"].resources.num_workers == 2
    raw["agents"]["a"]["rollout"]["placement"] = "colocated"
    with pytest.raises(ConfigError, match=r"2 workers cannot sample with agents\.a\.rollout\.engine: vllm"):
        validate_config(raw)
    del raw["agents"]["a"]["resources"]
    raw["agents"]["a"]["rollout"] = {"placement": "separate", "resources": {"num_workers": 2}}
    with pytest.raises(ConfigError, match=r"agents\.a\.rollout\.resources\.num_workers: 2, but an engine of its "
                                          r"own is one process"):
        validate_config(raw)
    raw["agents"]["a"]["rollout"] = {"placement": "separate"}
    raw["agents"]["a"]["adapter"] = {"rank": 4}  # an adapter agent of a host of its own: its engine takes the adapter
    assert validate_config(raw).agents["a"].adapter.rank == 4
    raw["hosts"] = {"h": {"resources": {"num_cpus": 0.5}}}
    raw["agents"]["a"]["host"] = "h"
    raw["agents"]["a"].pop("resources", None)
    assert validate_config(raw).agents["a"].host == "h"  # a shared host's agents: one engine apart for the host
    del raw["agents"]["a"]["adapter"], raw["agents"]["a"]["host"], raw["hosts"]
    raw["agents"]["a"]["rollout"] = {"resources": {"num_cpus": 0.5}}
    with pytest.raises(ConfigError, match=r"agents\.a\.rollout\.resources: engine resources are given but "
                                          r"agents\.a\.rollout\.placement is 'colocated'"):
        validate_config(raw)


def _placed(placement: str, k: int = 1) -> dict:
    """Engines in the learners' processes (in this process: no Ray) or in processes of their own (Ray), taking the
    weights by a gloo group (`group`) or through Ray's object store (`store`)."""
    raw = config(turns=2, ray=placement != "colocated", train={"steps": 4, "max_staleness": k},
                 eval={"data": {"factory": f"{ENVS}:held_out"}, "every": 1})  # evaluations between planned versions
    for spec in raw["agents"].values():
        spec["rollout"] = ({"placement": "colocated"} if placement == "colocated" else
                           {"placement": "separate", "resources": {"num_cpus": 0.5}, "weight_transfer": placement})
    return raw


@pytest.mark.parametrize("k,transfers", [(1, ("group", "store")), (2, ("group",))])
def test_a_separate_engine_samples_in_its_own_process_the_version_its_learner_published(ray_cluster, k, transfers):
    """The engines of their own take each planned version, by a gloo group with their learners or from the object
    store: on the tiny model (float32) the run's metrics equal those of engines in the learners' processes (an
    in-process run's, as a Ray run's with colocated engines are: tests/test_reliability.py), update for update,
    with K = 1 and, by the group (whose engine holds one version at a time), with K = 2."""
    runs = {}
    for placement in ("colocated", *transfers):
        with Coordinator(validate_config(_placed(placement, k)), None) as coord:
            info = coord.pool.start_info
            runs[placement] = coord.run() + [coord.evaluate()]
        if placement != "colocated":
            assert all(i["rollout_engine"]["pid"] != i["pid"] for i in info.values())
            assert coord.lag == k
            said = "a gloo group with its learner" if placement == "group" else "Ray's object store"
            assert all(i["weight_transfer"].startswith(said) for i in info.values())
    strip = lambda rows: [computed(r) for r in rows]
    for placement in transfers:
        assert strip(runs[placement]) == strip(runs["colocated"]), placement
        assert [r["staleness/a/max"] for r in runs[placement][:-1]] == [min(s, k) for s in range(4)]


def test_an_evaluation_never_puts_its_weights_between_a_rollouts_sync_and_its_generate(ray_cluster, monkeypatch):
    """Through the object store an evaluation does not wait for the rollouts played ahead: it puts the newest weights
    into the engine while a rollout draws with older ones, which the rollout's next generate puts back. A generate is
    sent before the lock of its sync is let go, so the evaluation's weights never land between the two. Each
    rollout's sync here is followed by 0.2 s in the lock, the window an evaluation would otherwise fall into."""
    from agent_trainer.actor import RayTrainers

    synced = RayTrainers._sync_engine

    def slow(self, agent, version):
        synced(self, agent, version)
        if version is not None:  # a rollout's (an evaluation asks for the newest: None)
            time.sleep(0.2)

    monkeypatch.setattr(RayTrainers, "_sync_engine", slow)
    with Coordinator(validate_config(_placed("store")), None) as coord:
        rows_ = coord.run()
    assert [r["step"] for r in rows_] == [1, 2, 3, 4]
    assert [r["staleness/a/max"] for r in rows_] == [0, 1, 1, 1]


def test_validate_says_how_far_ahead_rollouts_run(tmp_path):
    from tests.runs import marsi

    raw = config(turns=2, train={"max_staleness": 1}, schedule={"kind": "alternate"})
    out = marsi("validate", write(tmp_path, raw), "--steps", "1")
    assert out.returncode == 0, out.stderr
    assert ("asynchronous rollouts: train.max_staleness 1; each step's episodes are played 2 step(s) ahead, while "
            "earlier steps update; rollout engines of their own: none") in out.stdout


@pytest.mark.fast
def test_an_evaluation_partner_of_an_agent_with_an_engine_apart_samples_in_its_own_process():
    """A partner only generates: it gets no engine actor of its own (nor asks the cluster for one)."""
    from orchestrator.evaluation import partner_agents
    from protocols.plan import plan_of

    raw = config(train={"max_staleness": 1}, ray=True, eval={"data": {"factory": f"{ENVS}:held_out"},
                                                             "partners": {"first": {"a": "initial"}}})
    raw["agents"]["a"]["rollout"] = {"placement": "separate", "resources": {"num_cpus": 0.5}}
    cfg = validate_config(raw)
    (name, partner), = partner_agents(cfg).items()
    assert partner.rollout.placement == "colocated" and partner.rollout.resources is None
    trainers = cfg.model_copy(update={"agents": {**cfg.agents, name: partner}})
    assert list(plan_of(trainers).engine_resources) == ["a"]


@pytest.mark.fast
def test_an_engine_apart_holds_its_agent_never_a_critic_placed_with_it():
    from agent_trainer.actor import engine_config, engine_plan
    from protocols.plan import plan_of

    raw = config(ray=True, algorithm={"baseline": "critic"}, critic={"placement": "agent", "model": "agent"})
    raw["agents"]["a"]["rollout"] = {"placement": "separate", "resources": {"num_cpus": 0.5}}
    cfg = validate_config(raw)
    plan = plan_of(cfg)
    assert plan.member_layout["a"] == ["a", "critic"]  # the critic lives in a's learner process
    engine = engine_config(cfg, "a", plan.engine_layout["a"], plan.engine_resources["a"])
    assert engine_plan(engine).member_layout["a"] == ["a"]  # and not in its engine's


def _one_agent_apart(steps: int, **train) -> dict:
    raw = config(agents=("a",), ray=True, train={"steps": steps, "max_staleness": 1, **train})
    raw["agents"]["a"]["rollout"] = {"placement": "separate", "resources": {"num_cpus": 0.5}}
    return raw


def test_a_broadcast_whose_engine_hangs_or_dies_is_a_failure_of_its_agent_that_names_the_engine(ray_cluster):
    """The learner waits in the broadcast for an engine that is stopped (SIGSTOP): the pool gives up at the call
    timeout; then the engine is killed while the learner waits in the broadcast: the learner is freed at once and
    the failure is a recoverable one of the agent, naming its engine's death."""
    from agent_trainer.handle import TrainerFailure

    with Coordinator(validate_config(_one_agent_apart(1, call_timeout_s=3)), None) as coord:
        coord.run()  # the engine holds version 0, the learner 1
        pool, engine = coord.pool, coord.pool.start_info["a"]["rollout_engine"]["pid"]
        os.kill(engine, signal.SIGSTOP)
        try:
            with pytest.raises(TrainerFailure) as hung:
                pool.push_weights("a")
            assert hung.value.recoverable
            assert_quoted(str(hung.value))
            pool.call_timeout = 60.0
            outcome = {}
            pusher = threading.Thread(target=lambda: outcome.update(
                error=_raised(lambda: pool.push_weights("a"))))
            pusher.start()
            time.sleep(1.0)  # the learner is in the broadcast, waiting for the stopped engine
            os.kill(engine, signal.SIGKILL)
            pusher.join(30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(engine, signal.SIGCONT)
        error = outcome["error"]
        assert isinstance(error, TrainerFailure) and error.recoverable
        assert_quoted(str(error))


def _raised(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return exc
    return None


def test_a_run_whose_engine_apart_is_killed_restarts_and_ends_as_if_uninterrupted(ray_cluster, tmp_path):
    raw = _one_agent_apart(4)
    uninterrupted = uninterrupted_rows(validate_config(raw), tmp_path / "whole")
    with Coordinator(validate_config(raw), tmp_path / "run") as coord:
        run_killing(coord, coord.pool.start_info["a"]["rollout_engine"]["pid"], at_step=2)
        assert coord.restarts == 1
    assert without_times(rows(tmp_path / "run")) == uninterrupted


def test_where_no_process_group_forms_the_weights_go_through_the_object_store_and_the_start_says_why(
        ray_cluster, capsys):
    raw = _one_agent_apart(2)
    raw["ray"]["env_vars"] = {"GLOO_SOCKET_IFNAME": "marsi-no-such-interface"}  # gloo finds no device to bind
    with Coordinator(validate_config(raw), None) as coord:
        said = coord.pool.start_info["a"]["weight_transfer"]
        assert not coord.pool.engines_pushed
        rows_ = coord.run()
    assert said.startswith("Ray's object store (no process group could be formed: ") and "marsi-no-such-interface" in said
    assert [r["step"] for r in rows_] == [1, 2]
    assert f"marsi: weights to the rollout engines apart: a by {said}" in capsys.readouterr().out


_LOWERED = """
import json, os, threading
from agent_trainer import priority
from protocols.config import EnginePriority
started = threading.Event()
stop = threading.Event()
thread = threading.Thread(target=lambda: (started.set(), stop.wait()))
thread.start()
started.wait()
before = {t: os.getpriority(os.PRIO_PROCESS, t) for t in priority._threads()}
priority.lower(EnginePriority(**SETTING))
after = {t: (os.getpriority(os.PRIO_PROCESS, t), os.sched_getscheduler(t) == os.SCHED_IDLE) for t in before}
born = []
late = threading.Thread(target=lambda: born.append((os.getpriority(os.PRIO_PROCESS, 0),
                                                   os.sched_getscheduler(0) == os.SCHED_IDLE)))
late.start(); late.join(); stop.set(); thread.join()
print(json.dumps({"before": list(before.values()), "after": list(after.values()), "born": born[0],
                  "current": priority.current()}))
"""


@pytest.mark.fast
@pytest.mark.parametrize("setting", [{"niceness": 3}, {"idle": True}])
def test_an_engine_lowers_every_thread_of_its_process_and_the_threads_it_starts_after(setting):
    """Linux keeps niceness and scheduling class per thread: `priority.lower` sets the threads that exist (here the
    main one and a waiting one), and a thread started afterwards inherits it."""
    import json
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", _LOWERED.replace("SETTING", repr(setting))], capture_output=True,
                         text=True, check=True, cwd=Path(__file__).resolve().parent.parent).stdout
    got = json.loads(out)
    assert len(got["after"]) >= 2
    if setting.get("idle"):
        assert [list(a) for a in got["after"]] == [[b, True] for b in got["before"]]  # the class, niceness kept
        assert got["born"] == [got["before"][0], True] and got["current"]["scheduler"] == "idle"
    else:
        assert [list(a) for a in got["after"]] == [[min(19, b + 3), False] for b in got["before"]]
        assert got["born"] == [min(19, got["before"][0] + 3), False]
        assert got["current"] == {"nice": min(19, got["before"][0] + 3), "scheduler": "normal"}
