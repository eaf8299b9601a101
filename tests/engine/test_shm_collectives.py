"""The CPU tensor-parallel collectives over shared memory (engine/parallel/shm_collectives.py),
on 2 and 4 spawned rank processes: all-reduce, gather and broadcast give gloo's results (bitwise
for exact sums and for 2 ranks; 4 ranks' float sums agree within float rounding, since gloo
adds in its own order), every rank's all-reduce is bitwise the same, a tensor larger than a slot
goes over gloo, a peer that dies or never arrives fails the survivor's collective with
TensorParallelError naming it (the group's timeout set small: a safety net, not a speed bound),
and no segment is left in /dev/shm after shutdown, a killed peer, or a failed setup. The engine:
on by default, off with tensor_parallel_shm_collectives=False, the same greedy tokens either way."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.parallel.shard_plan import ShardPlan
from splitserve.engine.parallel.shm_collectives import SEGMENT_KEY, SLOT_BYTES
from splitserve.engine.parallel.shm_segment import SEGMENT_DIR, SEGMENT_PREFIX
from splitserve.engine.parallel.tp_group import TensorParallelError, TensorParallelGroup
from splitserve.engine.parallel.tp_ranks import follower_context
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import make_checkpoint

HOST = "127.0.0.1"
REPLY_WAIT_S = 240.0  # a safety net for a spawned rank's report (torch imports on a busy box)
_MODEL = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=128,
)


def _join(rank: int, size: int, port: int, shm: bool, timeout_s: float) -> TensorParallelGroup:
    store = dist.TCPStore(HOST, port, size, is_master=False, timeout=timedelta(seconds=timeout_s))
    return TensorParallelGroup.join(ShardPlan(_MODEL, size, rank), torch.device("cpu"), store, HOST, timeout_s, shm)


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _compare(rank: int, size: int, ports, conn) -> dict:
    """The same inputs through a shared-memory group and a gloo-only one: every difference,
    and digests of the shared-memory results for the parent to compare across ranks."""
    shm_group, gloo_group = (_join(rank, size, port, shm, 60.0) for port, shm in zip(ports, (True, False)))
    assert shm_group.shm is not None and gloo_group.shm is None
    gen = torch.Generator().manual_seed(rank)
    differences, digests = [], []

    def both(op: str, tensor: torch.Tensor, exact: bool) -> None:
        ours, theirs = getattr(shm_group, op)(tensor.clone()), getattr(gloo_group, op)(tensor.clone())
        if op == "gather_to_driver":
            ours, theirs = (torch.stack(parts) if parts is not None else None for parts in (ours, theirs))
        if ours is None or theirs is None:
            if ours is not theirs:
                differences.append(f"{op}: one side returned None")
            return
        same = torch.equal(ours, theirs) if exact else torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
        if not same:
            differences.append(f"{op} {tuple(tensor.shape)} {tensor.dtype}: {(ours - theirs).abs().max()}")
        if op != "gather_to_driver":
            digests.append(_digest(ours))

    for step in range(60):  # more collectives than slots: each slot is reused many times
        rows = 1 + step % 7
        floats = torch.randn(rows, 64, generator=gen)
        both("all_reduce", floats, exact=size == 2)  # a + b is b + a; 4 ranks: gloo's own order
        both("all_reduce", torch.randint(-999, 999, (rows, 64), generator=gen).float(), exact=True)
        both("all_reduce", torch.randint(-8, 8, (rows, 3), generator=gen).to(torch.bfloat16), exact=True)
        both("all_reduce", torch.randint(-(1 << 40), 1 << 40, (rows * 5,), generator=gen), exact=True)
        batch = torch.randint(0, 1 << 40, (3 * rows + 11,), generator=gen) if rank == 0 else torch.zeros(3 * rows + 11)
        both("broadcast", batch.long(), exact=True)
        both("gather_to_driver", torch.randn(rows, 50, generator=gen), exact=True)
    small = shm_group.shm.collectives
    # Larger than a slot: over gloo, on every rank alike.
    big = torch.randint(-999, 999, (SLOT_BYTES // 4 + 1,), generator=gen).float()
    both("all_reduce", big, exact=True)
    both("broadcast", big if rank == 0 else torch.zeros_like(big), exact=True)
    both("gather_to_driver", big, exact=True)
    fallback = shm_group.shm.collectives - small
    for group in (shm_group, gloo_group):
        group.shutdown()
    return {"differences": differences, "digests": digests, "shm_collectives": small, "fallback_on_shm": fallback}


def _stall(rank: int, size: int, ports, conn) -> dict:
    """One all-reduce together, then the last rank parks (the parent kills it, or lets it sit)
    while the others wait for it in the next all-reduce."""
    group = _join(rank, size, ports[0], True, float(os.environ["TEST_SHM_TIMEOUT_S"]))
    group.all_reduce(torch.ones(4))
    if rank == size - 1:
        conn.send(("parked", os.getpid()))
        time.sleep(REPLY_WAIT_S)
        return {}
    try:
        group.all_reduce(torch.ones(4))
    except TensorParallelError as exc:
        return {"error": str(exc)}
    finally:
        group.shutdown()
    return {"error": None}


def _stall_driver(rank: int, size: int, ports, conn) -> dict:
    """Rank 0 parks after one all-reduce; the followers wait for its next broadcast."""
    group = _join(rank, size, ports[0], True, float(os.environ["TEST_SHM_TIMEOUT_S"]))
    group.all_reduce(torch.ones(4))
    if rank == 0:
        conn.send(("parked", os.getpid()))
        time.sleep(REPLY_WAIT_S)
        return {}
    try:
        group.broadcast(torch.ones(4))
    except TensorParallelError as exc:
        return {"error": str(exc)}
    finally:
        group.shutdown()
    return {"error": None}


def _half_setup(rank: int, size: int, ports, conn) -> dict:
    """Rank 1 joins gloo only, sees the segment rank 0 made, and exits without mapping it."""
    if rank == 1:
        store = dist.TCPStore(HOST, ports[0], size, is_master=False, timeout=timedelta(seconds=60))
        group = TensorParallelGroup.join(ShardPlan(_MODEL, size, rank), torch.device("cpu"), store, HOST, 60.0, False)
        path = store.get(SEGMENT_KEY).decode()
        seen = {"path": path, "existed": os.path.exists(path)}
        group.shutdown()  # rank 0 still waits for this rank's word on the segment: it fails
        return seen
    try:
        _join(rank, size, ports[0], True, 60.0)
    except TensorParallelError as exc:
        return {"error": str(exc)}
    return {"error": None}


SCENARIOS = {"compare": _compare, "stall": _stall, "stall_driver": _stall_driver, "half_setup": _half_setup}


def _rank_main(rank: int, size: int, ports, scenario: str, timeout_s: float, conn) -> None:
    os.environ["TEST_SHM_TIMEOUT_S"] = str(timeout_s)  # a forked server's child has the server's environment
    try:
        conn.send(("done", {"pid": os.getpid(), **SCENARIOS[scenario](rank, size, ports, conn)}))
    except Exception as exc:
        conn.send(("done", {"pid": os.getpid(), "crash": f"{type(exc).__name__}: {exc}"}))


class Ranks:
    """size rank processes (started as the engine's followers are) over fresh stores (one per
    group), killed at the end."""

    def __init__(self, size: int, scenario: str, groups: int = 1, timeout_s: float = 60.0):
        context = follower_context()
        self.stores = [
            dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
            for _ in range(groups)
        ]
        ports = [store.port for store in self.stores]
        self.conns, self.processes = [], []
        for rank in range(size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=_rank_main, args=(rank, size, ports, scenario, timeout_s, child_end), daemon=True
            )
            process.start()
            child_end.close()
            self.conns.append(parent_end)
            self.processes.append(process)

    def receive(self, rank: int, kind: str = "done"):
        conn = self.conns[rank]
        assert conn.poll(REPLY_WAIT_S), f"rank {rank} sent nothing in {REPLY_WAIT_S:.0f}s"
        got, payload = conn.recv()
        assert got == kind, (got, payload)
        assert "crash" not in payload if kind == "done" else True, payload
        return payload

    def close(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(30)


def _segments(pid: int) -> list[str]:
    return [name for name in os.listdir(SEGMENT_DIR) if name.startswith(f"{SEGMENT_PREFIX}{pid}-")]


@pytest.mark.parametrize("size", [2, 4])
def test_shm_collectives_give_gloo_results_bitwise_equal_on_every_rank(size):
    ranks = Ranks(size, "compare", groups=2)
    try:
        results = [ranks.receive(rank) for rank in range(size)]
    finally:
        ranks.close()
    for rank, result in enumerate(results):
        assert result["differences"] == [], f"rank {rank}"
        assert result["shm_collectives"] == 60 * 6, f"rank {rank}: not every small collective went over shm"
        assert result["fallback_on_shm"] == 0, f"rank {rank}: a tensor larger than a slot went over shm"
    assert all(r["digests"] == results[0]["digests"] for r in results[1:]), "ranks' results differ"
    # Rank 0 named its segment after its pid: it is gone from /dev/shm, the ranks having exited.
    assert _segments(results[0]["pid"]) == []


@pytest.mark.parametrize("size", [2, 4])
def test_a_killed_peer_fails_the_survivors_collective_and_leaves_no_segment(size):
    ranks = Ranks(size, "stall", timeout_s=30.0)
    try:
        victim = ranks.receive(size - 1, "parked")
        os.kill(victim, signal.SIGKILL)
        errors = [ranks.receive(rank)["error"] for rank in range(size - 1)]
        driver_pid = ranks.processes[0].pid
    finally:
        ranks.close()
    for rank, error in enumerate(errors):
        assert error is not None and f"all-reduce on rank {rank} failed: rank {size - 1}" in error, error
    assert _segments(driver_pid) == []


def test_a_killed_driver_fails_the_followers_broadcast():
    ranks = Ranks(2, "stall_driver", timeout_s=30.0)
    try:
        driver = ranks.receive(0, "parked")
        os.kill(driver, signal.SIGKILL)
        error = ranks.receive(1)["error"]
    finally:
        ranks.close()
    assert error is not None and "broadcast on rank 1 failed: rank 0" in error, error
    assert _segments(driver) == []


def test_a_peer_that_never_arrives_fails_the_collective_at_the_group_timeout():
    ranks = Ranks(2, "stall", timeout_s=2.0)
    try:
        ranks.receive(1, "parked")  # alive, asleep: only the timeout can end rank 0's wait
        error = ranks.receive(0)["error"]
    finally:
        ranks.close()
    assert error is not None and "all-reduce on rank 0 failed: rank 1 did not reach collective #2 within 2s" in error


def test_a_setup_that_fails_leaves_no_segment():
    ranks = Ranks(2, "half_setup")
    try:
        seen = ranks.receive(1)
        error = ranks.receive(0)["error"]
    finally:
        ranks.close()
    assert seen["existed"], (seen, error)
    assert Path(seen["path"]).name.startswith(SEGMENT_PREFIX)
    assert error is not None and "rank 0" in error, error
    assert not os.path.exists(seen["path"])


def test_the_engine_uses_shm_by_default_and_gloo_when_told(models_root):
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 33, 2, 9], list(range(20, 50))]
    tokens = {}
    for shm in (True, False):
        engine = LLMEngine(
            EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=2, tensor_parallel_shm_collectives=shm)
        )
        try:
            group = engine.tensor_parallel.group
            assert (group.shm is not None) is shm
            tokens[shm] = [out.token_ids for out in engine.generate(prompts, params)]
            if shm:
                assert group.shm.collectives > 0
        finally:
            engine.close()
    assert tokens[True] == tokens[False]


def test_the_flag_must_be_a_bool():
    with pytest.raises(ConfigError, match="tensor_parallel_shm_collectives must be true or false"):
        EngineConfig(model="m", tensor_parallel_shm_collectives="yes")
