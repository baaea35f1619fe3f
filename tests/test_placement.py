"""Per-agent placement and the trainers' environment: what a config asks of Ray (bundles, actor options,
runtime_env), checked against the cluster before anything waits for it."""

from __future__ import annotations

import pytest

from agent_trainer.actor import actor_extras, bundle_of, forwarded_env, trainer_env
from agent_trainer.group import missing_resources
from agent_trainer.handle import PlacementError
from protocols.config import ConfigError, RayConfig, ResourcesConfig, validate_config
from tests.envs import config


@pytest.mark.fast
def test_custom_resources_and_gpu_type_go_into_the_bundle_and_the_actor_options():
    r = ResourcesConfig(num_gpus=1, num_cpus=2, custom={"big_node": 1}, accelerator_type="H100")
    assert bundle_of(r) == {"CPU": 2, "GPU": 1, "big_node": 1, "accelerator_type:H100": 0.001}
    env = {"env_vars": {"AWS_REGION": "eu-west-1"}}
    assert actor_extras(r, env) == {"resources": {"big_node": 1}, "accelerator_type": "H100", "runtime_env": env}
    assert actor_extras(ResourcesConfig(), None) == {}


@pytest.mark.fast
def test_a_resource_no_node_has_is_refused_at_once_naming_the_agent():
    r = {"a": ResourcesConfig(), "b": ResourcesConfig(accelerator_type="H100")}
    total = {"CPU": 8.0, "GPU": 2.0, "memory": 1e9, "accelerator_type:L4": 1.0, "node:10.0.0.1": 1.0}
    from tests.errors_doc import assert_documented

    assert_documented("placement_resource_missing", f"marsi: error: {missing_resources(r, {'a': ['a'], 'b': ['b']}, total)}")
    assert missing_resources({"a": ResourcesConfig(custom={"big_node": 1})}, {"a": ["a"]}, {"CPU": 1.0, "big_node": 1.0}) is None


@pytest.mark.fast
def test_forwarded_variables_reach_the_trainers_and_a_missing_one_is_named():
    """`ray.env_vars` go in Ray's runtime_env; `ray.forward_env` values go to each trainer's constructor instead
    (Ray's runtime_env agent logs its env_vars), and print as stars."""
    ray = RayConfig(env_vars={"AWS_REGION": "eu-west-1"}, forward_env=["AWS_ACCESS_KEY_ID"])
    assert trainer_env(ray) == {"env_vars": {"AWS_REGION": "eu-west-1"}}
    forwarded = forwarded_env(ray, {"AWS_ACCESS_KEY_ID": "key", "OTHER": "x"})
    assert {k: v.get_secret_value() for k, v in forwarded.values.items()} == {"AWS_ACCESS_KEY_ID": "key"}
    assert "key" not in repr(forwarded) and "key" not in str(forwarded.model_dump())
    assert trainer_env(RayConfig()) is None and forwarded_env(RayConfig(), {}).values == {}
    with pytest.raises(PlacementError, match=r"ray.forward_env: AWS_ACCESS_KEY_ID not set in this process's environment"):
        forwarded_env(ray, {})


@pytest.mark.fast
def test_custom_resources_are_checked_in_the_config():
    raw = config()
    raw["agents"]["a"]["resources"]["custom"] = {"GPU": 1}
    with pytest.raises(ConfigError, match=r"custom: 'GPU' is not a custom resource; use num_cpus, num_gpus or accelerator_type"):
        validate_config(raw)


@pytest.mark.fast
def test_a_strategy_of_its_own_gives_each_agent_a_placement_group_and_labels_go_into_its_bundles():
    from agent_trainer.actor import group_request, placement_plan

    plain = {"a": ResourcesConfig(), "b": ResourcesConfig(num_workers=2)}
    assert placement_plan(plain, "SPREAD") == [("SPREAD", ["a", "b"])]  # one group of all trainers
    assert group_request(plain, ["a", "b"]) == {"bundles": [{"CPU": 1.0}] * 3}  # no selector: Ray's default
    own = {"a": ResourcesConfig(label_selector={"zone": "in(a, b)"}), "b": ResourcesConfig(num_workers=2, placement_strategy="STRICT_PACK")}
    assert placement_plan(own, "PACK") == [("PACK", ["a"]), ("STRICT_PACK", ["b"])]
    assert group_request(own, ["a"]) == {"bundles": [{"CPU": 1.0}], "bundle_label_selector": [{"zone": "in(a, b)"}]}
    assert group_request({**own, "c": ResourcesConfig()}, ["a", "c"])["bundle_label_selector"] == [{"zone": "in(a, b)"}, {}]


@pytest.mark.fast
def test_label_selectors_match_as_ray_matches_them():
    from protocols.config import label_matches

    node = {"zone": "a", "market": "spot"}
    assert label_matches(node, {"zone": "a"}) and not label_matches(node, {"zone": "b"})
    assert label_matches(node, {"zone": "in(b, a)"}) and not label_matches(node, {"zone": "!in(a,b)"})
    assert label_matches(node, {"market": "!on-demand", "gpu": "!h100"})  # `!` holds where the label is missing
    assert not label_matches(node, {"gpu": "h100"}) and not label_matches(node, {"market": "!spot"})


@pytest.mark.fast
@pytest.mark.parametrize("selector, message", [
    ({"zone": "in()"}, "agents.b.resources.label_selector: zone: 'in()'; give a label value v, !v, in(v1,v2) or !in(v1,v2)"),
    ({"-zone": "a"}, "agents.b.resources.label_selector: '-zone' is not a node label name"),
])
def test_label_selectors_are_checked_in_the_config(selector, message):
    raw = config(ray=True)
    raw["agents"]["b"]["resources"]["label_selector"] = selector
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(raw)


@pytest.mark.fast
def test_a_strategy_per_agent_is_refused_under_a_strict_strategy_for_all():
    from tests.errors_doc import assert_documented

    raw = config(ray=True)
    raw["agents"]["b"]["resources"]["placement_strategy"] = "STRICT_PACK"
    raw["ray"]["placement_strategy"] = "STRICT_SPREAD"
    with pytest.raises(ConfigError) as info:
        validate_config(raw)
    assert_documented("placement_strategy_conflict", info.value)


@pytest.mark.fast
def test_a_label_selector_no_live_node_matches_is_refused_naming_the_agent():
    from agent_trainer.group import unmatched_labels
    from tests.errors_doc import assert_documented

    nodes = [{"Alive": True, "Labels": {"ray.io/node-id": "abc", "zone": "a"}},
             {"Alive": False, "Labels": {"ray.io/node-id": "def", "zone": "b"}}]  # lost: its labels count no more
    r = {"a": ResourcesConfig(label_selector={"zone": "a"}), "b": ResourcesConfig(label_selector={"zone": "b"})}
    problem = unmatched_labels(r, {"a": ["a"], "b": ["b"]}, nodes)
    assert_documented("placement_no_label_match", f"marsi: error: {problem}")
    assert unmatched_labels(r, {"a": ["a"], "b": ["b"]}, [{**nodes[1], "Alive": True}, nodes[0]]) is None
    shared = unmatched_labels({"h": r["b"]}, {"h": ["x", "y"]}, nodes)
    assert shared.startswith("hosts.h.resources.label_selector {'zone': 'b'}: no live node of the Ray cluster has these "
                             "labels, so agents 'x', 'y' cannot be placed")


def test_labels_strategies_and_environment_reach_the_trainers(ray_cluster, monkeypatch):
    """On the session's Ray: agent a asks for this node by its label and a STRICT_PACK group of its own; ray.env_vars
    and ray.forward_env are read inside each trainer's process. The forwarded variable is set after Ray started, so
    only forwarding brings it to a trainer; one that is not forwarded does not get there."""
    import os

    import ray

    from orchestrator.coordinator import Coordinator

    node = ray.get_runtime_context().get_node_id()
    monkeypatch.setenv("MARSI_FORWARDED", "from-the-shell")
    monkeypatch.setenv("MARSI_NOT_FORWARDED", "stays-here")
    raw = config(ray=True)
    raw["agents"]["a"]["resources"].update(label_selector={"ray.io/node-id": node}, placement_strategy="STRICT_PACK")
    raw["ray"].update(env_vars={"MARSI_FIXED": "fixed"}, forward_env=["MARSI_FORWARDED"])
    names = ["MARSI_FIXED", "MARSI_FORWARDED", "MARSI_NOT_FORWARDED"]

    def read_env(actor, names):  # runs inside the trainer's process
        return {name: os.environ.get(name) for name in names}

    with Coordinator(validate_config(raw)) as coord:
        pool = coord.pool
        tables = [ray.util.placement_group_table(g) for g in pool.groups]
        seen = {a: ray.get(pool.workers[a][0].__ray_call__.remote(read_env, names), timeout=60) for a in ("a", "b")}
        info = pool.info()
    assert [t["strategy"] for t in tables] == ["STRICT_PACK", "PACK"]  # a's own group; b under ray.placement_strategy
    assert info["a"]["node"] == node
    assert seen == dict.fromkeys(("a", "b"), {"MARSI_FIXED": "fixed", "MARSI_FORWARDED": "from-the-shell",
                                              "MARSI_NOT_FORWARDED": None})

    from agent_trainer.actor import group_request
    from ray.util.placement_group import placement_group, remove_placement_group

    # one group of all trainers, a selector on one bundle only: Ray takes the request as marsi builds it
    mixed = {"a": validate_config(raw).agents["a"].resources.model_copy(update={"placement_strategy": None}),
             "b": ResourcesConfig(num_cpus=0.5)}
    group = placement_group(strategy="PACK", **group_request(mixed, ["a", "b"]))
    try:
        assert ray.get(group.ready(), timeout=60)
        assert ray.util.placement_group_table(group)["bundles_to_node_id"] == {0: node, 1: node}
    finally:
        remove_placement_group(group)

    raw["agents"]["b"]["resources"]["label_selector"] = {"zone": "nowhere"}
    with pytest.raises(PlacementError) as refused:
        Coordinator(validate_config(raw)).start()
    assert str(refused.value).startswith("agents.b.resources.label_selector {'zone': 'nowhere'}: no live node of the "
                                         "Ray cluster has these labels, so agent 'b' cannot be placed")


def test_marsi_validate_checks_placement_against_the_cluster_it_would_join(ray_cluster, tmp_path, capsys):
    """With ray.address (or RAY_ADDRESS), `marsi validate` asks the cluster whether it can place every agent; here
    the session's Ray, to which this process is connected, stands for it."""
    from orchestrator.cli import main
    from tests.runs import write

    raw = config(ray=True)
    raw["ray"]["address"] = "10.0.0.1:6379"  # not dialled: this process is connected already
    assert main(["validate", str(write(tmp_path, raw))]) == 0
    assert "resources: trainers ask for 1 CPUs, 0 GPUs; the Ray cluster at 10.0.0.1:6379 can place them" in capsys.readouterr().out
    raw["agents"]["b"]["resources"]["label_selector"] = {"zone": "nowhere"}
    assert main(["validate", str(write(tmp_path, raw))]) == 2
    assert capsys.readouterr().err.startswith(
        "marsi: error: agents.b.resources.label_selector {'zone': 'nowhere'}: no live node of the Ray cluster has these "
        "labels, so agent 'b' cannot be placed")
