"""Shared fixtures: random checkpoints (made once per session) and a local Ray cluster."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models on 2 shared cores: more threads only wait on each other.
torch.set_num_threads(1)

from tests.helpers.model import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_root) -> str:
    """tiny llama (GQA) checkpoint directory."""
    return str(make_checkpoint(models_root, "tiny", "llama"))


@pytest.fixture(scope="module")
def loop():
    """An asyncio loop in a thread, for driving a DisaggCluster from synchronous tests."""
    from tests.helpers.cluster import LoopThread

    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole session, on 127.0.0.1."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=8,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level="ERROR",
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()
