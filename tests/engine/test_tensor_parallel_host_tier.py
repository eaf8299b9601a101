"""The host KV tier under tensor parallelism (engine/parallel/tp_host_kv.py): each rank keeps its
own KV heads' evicted blocks in its own host memory and reads them back on the driver's word.
The multi-turn workload of test_host_kv_tier.py on a device pool too small for it: a TP-2
engine with the tier loads later turns' history from host memory on both ranks and gives TP 1's
greedy tokens (a follower that had not reloaded its heads would attend to another sequence's
KV), in both step modes, with the pools back to baseline."""

from __future__ import annotations

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.parallel.tp_host_kv import TensorParallelHostKV
from tests.engine.test_host_kv_tier import BS, TIER_GIB, _chat
from tests.engine.test_worker_api import assert_baseline

BOTH_SCHEDULINGS = True  # async scheduling overlaps the copies' headers with forwards in flight


def _engine(model: str, tp: int, tier: float) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=model, block_size=BS, num_kv_blocks=12, kv_offloading_size=tier, tensor_parallel_size=tp)
    )


def test_tp2_host_tier_reloads_every_ranks_heads(tiny_model):
    reference = _chat(_engine(tiny_model, 1, 0.0))
    tiered = _engine(tiny_model, 2, TIER_GIB)
    try:
        assert isinstance(tiered.host_kv_cache, TensorParallelHostKV)
        # Per rank: this rank's KV heads (one of the tiny model's two) per block.
        assert tiered.host_kv_cache.nbytes == tiered.kv.host.num_blocks * tiered.kv_cache.bytes_per_block
        assert _chat(tiered) == reference
        stats = tiered.stats()
        assert stats.host_loaded_blocks > 0 and stats.host_loads > 0 and stats.host_stored_blocks > 0
        assert stats.host_hit_tokens == stats.host_loaded_blocks * BS
        assert_baseline(tiered)
    finally:
        tiered.close()
