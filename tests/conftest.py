import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray for the whole session, with 2 logical GPUs so GPU placement is exercised on CPU."""
    import ray

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def join_ray_cluster(ray_cluster) -> dict[str, str]:
    """The environment a `marsi` (or Python) subprocess needs to join the session's Ray rather than start a cluster
    of its own (seconds of CPU each): RAY_ADDRESS. Its trainers are its job's actors: they end with it, however it
    ends (a SIGKILLed driver takes its non-detached actors with it)."""
    import ray

    return {"RAY_ADDRESS": ray.get_runtime_context().gcs_address}


FAST_MODULES = {"test_config", "test_losses", "test_attention", "test_plot", "test_example_envs", "test_dispatch",
                "test_docs", "test_import_cycles", "test_architecture"}
"""Modules whose tests train no model and start no Ray (a test that asks for `ray_cluster` excepted)."""


def pytest_collection_modifyitems(items):
    """Mark the fast tier (`make test-fast`, `pytest -m fast`): what needs no model training and no Ray."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if (module in FAST_MODULES and "ray_cluster" not in item.fixturenames
                and not item.get_closest_marker("slow") and not item.get_closest_marker("subprocess")):
            item.add_marker(pytest.mark.fast)
