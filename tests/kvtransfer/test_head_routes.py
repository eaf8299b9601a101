"""KV transfer between prefill and decode TP sizes a and b, rank by rank, over real gloo pairs
(every rank's KVTransport in this process: bench/gpu_check/gpu_check_tp_transfer.py's
transfer_over_routes, which the GPU check runs on the device): each decode rank ends up with
exactly the KV heads it holds of every transferred block, value for value (and for an int8 cache, scale byte for
scale byte), whatever a, b and the KV heads (split, sliced, or replicated); the bytes on the
wire -- counted by the transports -- are the TP 1/1 figure (times the decode replication,
where decode ranks share a head), and a prefill rank whose heads nobody draws from sends
nothing. Plus the head map itself and its one-line refusal."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from splitserve.bench.gpu_check.gpu_check_tp_transfer import transfer_over_routes
from splitserve.engine.config import ConfigError
from splitserve.engine.model_config import ModelConfig
from splitserve.kvtransfer.head_map import (
    RECEIVER,
    SENDER,
    KVLayout,
    check_head_map,
    head_routes,
    rank_endpoint,
    rank_routes,
)
from tests.helpers.model import make_checkpoint


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
    model = ModelConfig.from_pretrained(str(make_checkpoint(models_root, "tiny", "llama")))
    model = dataclasses.replace(model, num_key_value_heads=kv_heads)
    got = transfer_over_routes(
        model,
        KVLayout(kv_heads, prefill_size),
        KVLayout(kv_heads, decode_size),
        kv_cache_dtype,
        layerwise,
        torch.device("cpu"),
    )
    assert got["exact"]  # each decode rank: its heads of the sent blocks, value for value; nothing else
    replication = max(decode_size // kv_heads, 1)
    assert got["replication"] == replication
    assert (
        got["sent"] == got["received"] == got["counted_sent"] == got["counted_received"] == got["one_one"] * replication
    )
    assert got["idle_prefill_ranks"] == ([1] if (kv_heads, prefill_size, decode_size) == (1, 2, 1) else [])
