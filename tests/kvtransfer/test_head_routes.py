"""KV transfer between prefill and decode TP sizes a and b, rank by rank, over real gloo pairs
(every rank's KVTransport in this process): each decode rank ends up with exactly the KV heads
it holds of every transferred block, value for value (and for an int8 cache, scale byte for
scale byte), whatever a, b and the KV heads (split, sliced, or replicated); the bytes on the
wire -- counted by the transports -- are the TP 1/1 figure (times the decode replication,
where decode ranks share a head), and a prefill rank whose heads nobody draws from sends
nothing. Plus the head map itself and its one-line refusal."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest
import torch

from splitserve.engine.config import ConfigError, EngineConfig, ModelConfig
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.head_map import (
    RECEIVER,
    SENDER,
    KVLayout,
    check_head_map,
    head_routes,
    rank_endpoint,
    rank_routes,
)
from splitserve.kvtransfer.kv_receiver import PostedReceive
from splitserve.kvtransfer.kv_sender import KVSender
from splitserve.kvtransfer.rank_commands import ReplicaKVAddress
from splitserve.kvtransfer.send_job import SendJob
from splitserve.kvtransfer.tp_transport import open_routes
from splitserve.kvtransfer.transport import KVTransport
from tests.helpers.model import make_checkpoint

NUM_BLOCKS = 10
TIMEOUT_S = 20.0
SRC_BLOCKS, DST_BLOCKS = [6, 2, 3, 9], [1, 2, 3, 4]  # scattered on prefill, a run on decode
_ids = itertools.count(1)


def test_the_head_map_of_each_pairing():
    def table(heads, a, b):
        return [
            (r.prefill_rank, r.decode_rank, r.start, r.stop, r.whole)
            for r in head_routes(KVLayout(heads, a), KVLayout(heads, b))
        ]

    assert table(2, 1, 1) == [(0, 0, 0, 2, True)]
    assert table(2, 2, 2) == [(0, 0, 0, 1, True), (1, 1, 1, 2, True)]
    assert table(2, 2, 1) == [(0, 0, 0, 1, False), (1, 0, 1, 2, False)]  # a > b: d0 draws from both
    assert table(2, 1, 2) == [(0, 0, 0, 1, False), (0, 1, 1, 2, False)]  # a < b: p0 splits its heads
    assert table(1, 2, 1) == [(0, 0, 0, 1, True)]  # replicated on prefill: rank 1 sends nothing
    assert table(1, 2, 2) == [(0, 0, 0, 1, True), (1, 1, 0, 1, True)]  # both replicated: rank i -> i
    assert table(1, 1, 2) == [(0, 0, 0, 1, True), (0, 1, 0, 1, True)]  # decode keeps the head twice
    assert table(4, 4, 2)[:2] == [(0, 0, 0, 1, False), (1, 0, 1, 2, False)]
    # Rank 0 always pairs with rank 0, on each side's routes.
    assert rank_routes(KVLayout(4, 2), KVLayout(4, 4), SENDER, 0, "d")[0].endpoint == "d"
    assert rank_routes(KVLayout(4, 4), KVLayout(4, 2), RECEIVER, 1, "p")[0].endpoint == rank_endpoint("p", 0)


def test_sizes_that_cannot_share_the_heads_are_one_line_naming_the_numbers():
    with pytest.raises(ConfigError) as caught:
        check_head_map(4, 2, 3)
    message = str(caught.value)
    assert "\n" not in message
    assert all(
        part in message for part in ("prefill tensor_parallel_size 2", "decode tensor_parallel_size 3", "4 KV heads")
    )
    with pytest.raises(ConfigError, match="4 KV heads, decode one of 2"):
        head_routes(KVLayout(4, 1), KVLayout(2, 1))


def _segments(cache: KVCache) -> list[torch.Tensor]:
    """The cache as [layers, 2, blocks, block_size, heads, width] views: values, then scales."""
    shape = (cache.num_layers, 2, cache.num_blocks, cache.block_size, cache.num_kv_heads, -1)
    if not cache.quantized:
        return [cache.kv.view(shape)]
    value_bytes = cache.block_size * cache.num_kv_heads * cache.head_dim
    return [cache.kv[..., :value_bytes].reshape(shape), cache.kv[..., value_bytes:].reshape(shape)]


def _cache(model_config: ModelConfig, heads: int, kv_cache_dtype: str) -> KVCache:
    local = dataclasses.replace(model_config, num_key_value_heads=heads)
    return KVCache(local, EngineConfig(model="unused", num_kv_blocks=NUM_BLOCKS, kv_cache_dtype=kv_cache_dtype))


def _copy_heads(src: KVCache, src_heads: range, dst: KVCache, dst_start: int, blocks=slice(None)) -> None:
    for s, d in zip(_segments(src), _segments(dst)):
        d[:, :, blocks, :, dst_start : dst_start + len(src_heads)] = s[
            :, :, blocks, :, src_heads.start : src_heads.stop
        ]


@pytest.mark.parametrize(
    ("kv_heads", "prefill_size", "decode_size", "kv_cache_dtype", "layerwise"),
    [
        (2, 1, 1, "auto", True),
        (2, 2, 1, "auto", True),
        (2, 1, 2, "auto", False),
        (2, 2, 2, "auto", True),
        (4, 4, 2, "auto", True),
        (4, 2, 4, "int8", True),
        (2, 2, 1, "int8", False),
        (1, 2, 1, "auto", True),  # prefill replicates the one KV head: only rank 0 sends
        (1, 1, 2, "int8", True),  # decode replicates it: each decode rank gets its copy
    ],
)
def test_each_decode_rank_receives_exactly_its_heads_and_the_wire_carries_the_1_1_bytes(
    models_root, kv_heads, prefill_size, decode_size, kv_cache_dtype, layerwise
):
    model_config = ModelConfig.from_pretrained(str(make_checkpoint(models_root, "tiny", "llama")))
    prefill, decode = KVLayout(kv_heads, prefill_size), KVLayout(kv_heads, decode_size)
    whole = _cache(model_config, kv_heads, kv_cache_dtype)
    torch.manual_seed(kv_heads * 100 + prefill_size * 10 + decode_size)
    if whole.quantized:
        whole.kv.copy_(torch.randint(0, 256, whole.kv.shape, dtype=torch.uint8))
    else:
        whole.kv.normal_()
    senders_caches = [_cache(model_config, len(prefill.heads(p)), kv_cache_dtype) for p in range(prefill_size)]
    for p, cache in enumerate(senders_caches):
        _copy_heads(whole, prefill.heads(p), cache, 0)
    receivers_caches = [_cache(model_config, len(decode.heads(d)), kv_cache_dtype) for d in range(decode_size)]

    senders = [KVTransport(rank_endpoint("P", p), "cpu", timeout_s=TIMEOUT_S) for p in range(prefill_size)]
    receivers = [KVTransport(rank_endpoint("D", d), "cpu", timeout_s=TIMEOUT_S) for d in range(decode_size)]
    prefill_address = ReplicaKVAddress(prefill, tuple(t.address for t in senders))
    decode_address = ReplicaKVAddress(decode, tuple(t.address for t in receivers))
    send_routes = [rank_routes(prefill, decode, SENDER, p, "D") for p in range(prefill_size)]
    recv_routes = [rank_routes(decode, prefill, RECEIVER, d, "P") for d in range(decode_size)]
    openings = [
        threading.Thread(target=open_routes, args=(t, routes, decode_address, SENDER, 0))
        for t, routes in zip(senders, send_routes)
    ] + [
        threading.Thread(target=open_routes, args=(t, routes, prefill_address, RECEIVER, 0))
        for t, routes in zip(receivers, recv_routes)
    ]
    for thread in openings:
        thread.start()
    for thread in openings:
        thread.join(TIMEOUT_S * 2)
    kv_senders = [
        KVSender(t, cache, lambda peer, routes=routes: routes)
        for t, cache, routes in zip(senders, senders_caches, send_routes)
    ]
    try:
        transfer_id = next(_ids)
        posted = [
            PostedReceive(t, cache, "P", transfer_id, DST_BLOCKS, layerwise, routes)
            for t, cache, routes in zip(receivers, receivers_caches, recv_routes)
        ]
        jobs = [
            SendJob("r", "D", transfer_id, list(SRC_BLOCKS), layerwise, num_blocks=len(SRC_BLOCKS)) for _ in kv_senders
        ]
        for sender, job in zip(kv_senders, jobs):
            sender.send_all(job)
        received = sum(p.complete(TIMEOUT_S)[0] for p in posted)
        for job in jobs:
            job.done.result(TIMEOUT_S)
        # Each decode rank holds its heads of the prefill blocks, exactly.
        for d, cache in enumerate(receivers_caches):
            expected = _cache(model_config, len(decode.heads(d)), kv_cache_dtype)
            _copy_heads(whole, decode.heads(d), expected, 0)
            for got, want in zip(_segments(cache), _segments(expected)):
                assert torch.equal(got[:, :, DST_BLOCKS], want[:, :, SRC_BLOCKS])
                assert not got[:, :, [0, 5]].any()  # blocks outside the transfer untouched
        replication = max(decode_size // kv_heads, 1)
        one_one = len(SRC_BLOCKS) * whole.bytes_per_block
        assert sum(job.num_bytes for job in jobs) == received == one_one * replication
        assert (
            sum(t.stats().bytes_sent for t in senders) == sum(t.stats().bytes_received for t in receivers) == received
        )
        idle = [p for p in range(prefill_size) if not send_routes[p]]
        assert all(jobs[p].num_bytes == 0 for p in idle)
        assert idle == ([1] if (kv_heads, prefill_size, decode_size) == (1, 2, 1) else [])
    finally:
        for sender in kv_senders:
            sender.close()
        for t in senders + receivers:
            t.close()
