"""How a handle call fans out over an agent's data-parallel workers: declared per method, refused when missing,
and applied by the Ray pool (rows concatenated in worker order, worker 0 alone, all workers checked equal)."""

from __future__ import annotations

import pytest

from agent_trainer.agent import Agent
from agent_trainer.dispatch import Dispatch, WorkersDisagree, check_registered, dispatch_of, register
from agent_trainer.handle import TrainerFailure
from protocols.messages import Completion, GenerateRequest, GenerateResult, UpdateRequest, UpdateResult


def test_every_agent_method_declares_its_dispatch():
    assert {name: dispatch_of(getattr(Agent, name)) for name in ("generate", "update", "save", "load", "probe",
                                                                 "digest", "score")} == {
        "generate": Dispatch.ROWS, "update": Dispatch.ALL_EQUAL, "save": Dispatch.RANK_ZERO,
        "load": Dispatch.ALL_EQUAL, "probe": Dispatch.ALL_TRUE, "digest": Dispatch.RANK_ZERO,
        "score": Dispatch.RANK_ZERO}


def test_a_method_without_a_dispatch_is_refused_where_its_class_is_defined():
    with pytest.raises(TypeError, match=r"Undeclared.extra' declares no dispatch; decorate it with @register"):
        @check_registered
        class Undeclared:
            @register(Dispatch.ROWS)
            def generate(self, request): ...

            def extra(self): ...

    class MoreAgent(Agent):  # a new method on the agent, left undeclared
        def peek(self) -> str: ...

    with pytest.raises(TypeError, match=r"MoreAgent.peek' declares no dispatch"):
        check_registered(MoreAgent)
    with pytest.raises(TypeError, match="is not a Dispatch"):
        register("rows")


def test_a_pool_refuses_a_method_that_declares_no_dispatch():
    from agent_trainer.group import LocalTrainers

    pool = object.__new__(LocalTrainers)  # no trainers needed: the method is refused before any runs
    pool.agents, pool.hosts, pool.threads, pool.set_threads = ["a"], {}, {"a": 1}, lambda n: None

    def peek(agent): ...

    with pytest.raises(TypeError, match="declares no dispatch"):
        pool.ask(peek, ["a"])


def completion(text: str) -> Completion:
    return Completion(text=text, prompt_ids=[1], completion_ids=[2], per_token_logps=[-0.5], finish_reason="length")


def update_result(loss: float, seconds: float) -> UpdateResult:
    return UpdateResult(agent="a", policy_version=1, loss=loss, grad_norm=1.0, kl=0.0, entropy=1.0, clip_fraction=0.0,
                        lr=1e-3, num_tokens=4, num_sequences=2, seconds=seconds)


def test_collect_concatenates_rows_in_worker_order_and_checks_equal_answers_apart_from_timings():
    shares = [GenerateResult(agent="a", completions=[completion(t) for t in share], seconds=s)
              for share, s in ((["r0", "r1"], 1.0), (["r2"], 3.0), ([], 0.5))]
    merged = Dispatch.ROWS.collect(shares)
    assert [c.text for c in merged.completions] == ["r0", "r1", "r2"] and merged.seconds == 3.0
    assert Dispatch.RANK_ZERO.collect(["first", "second"]) == "first"
    same = Dispatch.ALL_EQUAL.collect([update_result(0.5, 1.0), update_result(0.5, 2.0)])  # timings may differ
    assert same.loss == 0.5 and same.seconds == 1.0
    with pytest.raises(WorkersDisagree, match="worker 1 of 2 answered loss=0.25 where worker 0 answered loss=0.5"):
        Dispatch.ALL_EQUAL.collect([update_result(0.5, 1.0), update_result(0.25, 1.0)])
    assert Dispatch.ALL_TRUE.collect([True, True]) and not Dispatch.ALL_TRUE.collect([True, False])


class _FakeWorker:
    """Worker `rank` of 3 answering as an agent's worker would; records the methods it was sent."""

    def __init__(self, rank: int, diverged: bool = False):
        self.rank, self.diverged, self.seen = rank, diverged, []

    def call(self, agent, method, *args):
        from agent_trainer.workers import share

        self.seen.append(method)
        if method == "generate":
            first, last = share(len(args[0].prompts), self.rank, 3)
            return GenerateResult(agent=agent, completions=[completion(p) for p in args[0].prompts[first:last]],
                                  seconds=0.1)
        if method == "update":
            return update_result(0.25 if self.diverged and self.rank == 2 else 0.5, seconds=0.1 * self.rank)
        return f"digest of worker {self.rank}"

    def methods(self):
        return self.seen


def test_the_ray_pool_sends_each_call_to_the_workers_its_dispatch_names(ray_cluster):
    import ray

    from agent_trainer.actor import RayTrainers

    remote = ray.remote(num_cpus=0)(_FakeWorker)
    pool = object.__new__(RayTrainers)
    pool.agents, pool.call_timeout, pool.checkpoint_timeout = ["a", "b"], 60, 60
    pool.workers = {"a": [remote.remote(rank) for rank in range(3)],
                    "b": [remote.remote(rank, diverged=True) for rank in range(3)]}
    pool.housemates = {"a": ["a"], "b": ["b"]}

    result = pool["a"].generate(GenerateRequest(prompts=[f"p{i}" for i in range(7)], seed=0))
    assert [c.text for c in result.completions] == [f"p{i}" for i in range(7)]  # shares 3, 2, 2 in worker order
    assert pool["a"].digest() == "digest of worker 0"
    assert pool["a"].update(UpdateRequest(experiences=[])).loss == 0.5  # all three agree (timings apart)
    with pytest.raises(TrainerFailure, match=r"agent 'b': update failed: its workers disagree: worker 2 of 3 "
                                                r"answered loss=0.25 where worker 0 answered loss=0.5$"):
        pool.each(Agent.update, dict.fromkeys(["a", "b"], UpdateRequest(experiences=[])))
    sent = ray.get([worker.methods.remote() for worker in pool.workers["a"]])
    assert sent == [["generate", "digest", "update", "update"], ["generate", "update", "update"],
                    ["generate", "update", "update"]]  # digest: worker 0 alone


def test_declarations_give_each_method_its_timeout_class_engine_route_and_publishing_and_make_the_handles():
    from agent_trainer.critic import Critic
    from agent_trainer.dispatch import Publish, Timeout, declaration_of
    from agent_trainer.handle import AgentHandle, CriticHandle, TrainerPool

    checkpoint = {n for n in ("generate", "update", "save", "load", "probe", "digest", "score", "version")
                  if declaration_of(getattr(Agent, n)).timeout is Timeout.CHECKPOINT}
    assert checkpoint == {"save", "load", "probe", "version"}
    assert [n for n in ("generate", "update", "load", "score") if declaration_of(getattr(Agent, n)).engine] == ["generate"]
    assert declaration_of(Agent.update).publishes is Publish.UPDATED
    assert declaration_of(Agent.load).publishes is Publish.RELOADED and declaration_of(Critic.values).publishes is None
    assert hasattr(AgentHandle, "generate") and not hasattr(AgentHandle, "values")
    assert {"values", "update", "save", "load"} <= set(vars(CriticHandle)) and not hasattr(CriticHandle, "generate")

    class Recording(TrainerPool):  # what the pool is asked: method, members' arguments, bound
        agents, critics, call_timeout, checkpoint_timeout = ["a", "c"], {"c"}, 10.0, 99.0

        def __init__(self):
            self.calls = []

        def _fan_out(self, method, calls, timeout):
            self.calls.append((declaration_of(method).name, calls, timeout))
            return dict.fromkeys(calls, "answer")

        def info(self, timeout=None): ...
        def close(self): ...

    pool = Recording()
    assert pool["a"].digest() == "answer" and pool["c"].values("states") == "answer"
    pool.each(Agent.save, {"a": "request"})
    pool.each(Agent.update, {"a": "request"}, timeout=None)  # an explicit bound wins: None, no bound
    assert pool.calls == [("digest", {"a": ()}, 10.0), ("values", {"c": ("states",)}, 10.0),
                          ("save", {"a": ("request",)}, 99.0), ("update", {"a": ("request",)}, None)]
