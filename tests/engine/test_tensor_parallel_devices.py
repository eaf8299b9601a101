"""Which GPU each tensor-parallel rank uses (engine/parallel/tp_group.rank_device), with CUDA
faked on this CPU machine: ranks spawned by one process see every GPU of the node and rank r
takes the r-th; a Ray rank actor sees only the GPU Ray gave it (CUDA_VISIBLE_DEVICES), so every
rank of a served gang uses its own cuda:0 -- asking for cuda:1 there would fail on a GPU node.
tests/cluster/test_tensor_parallel_gpus.py checks that Ray gives each rank of a gang its own GPU."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import ConfigError
from splitserve.engine.parallel.tp_group import rank_device


@pytest.fixture
def visible_gpus(monkeypatch):
    """Fake a process that sees `count` CUDA devices."""

    def fake(count: int, env: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)

    return fake


def test_spawned_ranks_take_the_nodes_gpus_in_turn(visible_gpus):
    visible_gpus(4, "0,1,2,3")
    assert [rank_device("cuda", r, 2) for r in range(2)] == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert rank_device("cuda:2", 1, 2) == torch.device("cuda", 3)
    with pytest.raises(
        ConfigError, match="tensor_parallel_size 4 from cuda:1 needs 5 CUDA devices on this node, it has 4"
    ):
        rank_device("cuda:1", 0, 4)


def test_a_ray_rank_uses_the_one_gpu_it_sees(visible_gpus):
    visible_gpus(1, "5")  # what Ray sets for an actor given GPU 5
    for rank in range(4):
        assert rank_device("cuda", rank, 4, own_device=True) == torch.device("cuda")
    with pytest.raises(ConfigError, match="needs 4 CUDA devices on this node, it has 1"):
        rank_device("cuda", 3, 4)  # the spawned-rank rule would ask for a GPU it cannot see


def test_a_ray_rank_without_a_gpu_is_a_one_line_error(visible_gpus):
    visible_gpus(0, "")
    with pytest.raises(ConfigError) as raised:
        rank_device("cuda", 1, 2, own_device=True)
    message = str(raised.value)
    assert message == (
        "tensor-parallel rank 1 of 2 sees 0 CUDA devices for cuda (CUDA_VISIBLE_DEVICES=''): "
        "give the pool num_gpus 1 per rank"
    )


def test_cpu_ranks_share_the_cpu():
    assert rank_device("cpu", 1, 2) == rank_device("cpu", 1, 2, own_device=True) == torch.device("cpu")
