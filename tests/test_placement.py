"""Per-agent placement and the trainers' environment: what a config asks of Ray (bundles, actor options,
runtime_env), checked against the cluster before anything waits for it."""

from __future__ import annotations

import pytest

from agent_trainer.actor import actor_extras, bundle_of, missing_resources, trainer_env
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
    assert missing_resources(r, {"a": ["a"], "b": ["b"]}, total) == (
        "agents.b.resources.accelerator_type 'H100': no node of the Ray cluster has it (custom resources and GPU types "
        "here: accelerator_type:L4); start a node with it (ray start --resources=...) or change the setting")
    assert missing_resources({"a": ResourcesConfig(custom={"big_node": 1})}, {"a": ["a"]}, {"CPU": 1.0, "big_node": 1.0}) is None


@pytest.mark.fast
def test_forwarded_variables_reach_the_trainers_and_a_missing_one_is_named():
    ray = RayConfig(env_vars={"AWS_REGION": "eu-west-1"}, forward_env=["AWS_ACCESS_KEY_ID"])
    assert trainer_env(ray, {"AWS_ACCESS_KEY_ID": "key", "OTHER": "x"}) == {
        "env_vars": {"AWS_REGION": "eu-west-1", "AWS_ACCESS_KEY_ID": "key"}}
    assert trainer_env(RayConfig(), {}) is None
    with pytest.raises(PlacementError, match=r"ray.forward_env: AWS_ACCESS_KEY_ID not set in this process's environment"):
        trainer_env(ray, {})


@pytest.mark.fast
def test_custom_resources_are_checked_in_the_config():
    raw = config()
    raw["agents"]["a"]["resources"]["custom"] = {"GPU": 1}
    with pytest.raises(ConfigError, match=r"custom: 'GPU' is not a custom resource; use num_cpus, num_gpus or accelerator_type"):
        validate_config(raw)
