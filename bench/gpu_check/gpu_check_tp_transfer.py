"""Check 11: KV transfer between prefill and decode TP sizes, rank by rank, on the device.

Every rank's KVTransport lives in this process (on one GPU its pairs take the same-device
`host` channel: NCCL refuses two ranks on one device), each with a real KVCache of its own KV
heads: prefill rank p holds its heads of a random whole-model cache, and after one transfer
along the head map (kvtransfer/head_map.py) each decode rank must hold exactly its heads of
the sent blocks, bit for bit (an int8 cache: values and scales), nothing else written, and the
transports must have counted the TP 1/1 bytes (times the decode replication). On CUDA this runs
the head slices' gathers and scatters (index_select / index_copy_ on strided views) on the
device; the 2-GPU NCCL pairs between ranks cannot run on one GPU. tests/kvtransfer/
test_head_routes.py runs transfer_over_routes on CPU for nine pairings.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import torch

from splitserve.bench.gpu_check.gpu_check_ops import item
from splitserve.engine.config import EngineConfig
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.head_map import RECEIVER, SENDER, KVLayout, rank_endpoint, rank_routes
from splitserve.kvtransfer.kv_receiver import PostedReceive
from splitserve.kvtransfer.kv_sender import KVSender
from splitserve.kvtransfer.rank_commands import ReplicaKVAddress
from splitserve.kvtransfer.send_job import SendJob
from splitserve.kvtransfer.tp_transport import open_routes
from splitserve.kvtransfer.transport import KVTransport

TIMEOUT_S = 60.0
SRC_BLOCKS, DST_BLOCKS = [6, 2, 3, 9], [1, 2, 3, 4]  # scattered on prefill, a run on decode
_ids = itertools.count(1)


def _segments(cache: KVCache) -> list[torch.Tensor]:
    """The cache as [layers, 2, blocks, block_size, heads, width] views: values, then scales."""
    shape = (cache.num_layers, 2, cache.num_blocks, cache.block_size, cache.num_kv_heads, -1)
    if not cache.quantized:
        return [cache.kv.view(shape)]
    value_bytes = cache.block_size * cache.num_kv_heads * cache.head_dim
    return [cache.kv[..., :value_bytes].reshape(shape), cache.kv[..., value_bytes:].reshape(shape)]


def _cache(model: ModelConfig, heads: int, kv_cache_dtype: str, device: torch.device) -> KVCache:
    local = dataclasses.replace(model, num_key_value_heads=heads)
    config = EngineConfig(model="unused", num_kv_blocks=10, kv_cache_dtype=kv_cache_dtype, device=str(device))
    return KVCache(local, config)


def _copy_heads(src: KVCache, heads: range, dst: KVCache) -> None:
    for s, d in zip(_segments(src), _segments(dst)):
        d.copy_(s[:, :, :, :, heads.start : heads.stop])


def transfer_over_routes(
    model: ModelConfig,
    prefill: KVLayout,
    decode: KVLayout,
    kv_cache_dtype: str,
    layerwise: bool,
    device: torch.device,
    same_device: str = "auto",
) -> dict:
    """One transfer of SRC_BLOCKS into DST_BLOCKS between the ranks of a prefill and a decode
    replica. Returns whether each decode rank got exactly its heads, the bytes each side's
    transports counted, the 1/1 figure, and which prefill ranks sent nothing."""
    torch.manual_seed(prefill.num_kv_heads * 100 + prefill.tensor_parallel_size * 10 + decode.tensor_parallel_size)
    whole = _cache(model, prefill.num_kv_heads, kv_cache_dtype, device)
    if whole.quantized:
        whole.kv.copy_(torch.randint(0, 256, whole.kv.shape, dtype=torch.uint8))
    else:
        whole.kv.normal_()
    prefill_caches, decode_caches, expected = [], [], []
    for p in range(prefill.tensor_parallel_size):
        prefill_caches.append(_cache(model, len(prefill.heads(p)), kv_cache_dtype, device))
        _copy_heads(whole, prefill.heads(p), prefill_caches[-1])
    for d in range(decode.tensor_parallel_size):
        decode_caches.append(_cache(model, len(decode.heads(d)), kv_cache_dtype, device))
        expected.append(_cache(model, len(decode.heads(d)), kv_cache_dtype, device))
        _copy_heads(whole, decode.heads(d), expected[-1])
    senders = [
        KVTransport(rank_endpoint("P", p), device, timeout_s=TIMEOUT_S, same_device=same_device)
        for p in range(prefill.tensor_parallel_size)
    ]
    receivers = [
        KVTransport(rank_endpoint("D", d), device, timeout_s=TIMEOUT_S) for d in range(decode.tensor_parallel_size)
    ]
    send_routes = [rank_routes(prefill, decode, SENDER, p, "D") for p in range(prefill.tensor_parallel_size)]
    recv_routes = [rank_routes(decode, prefill, RECEIVER, d, "P") for d in range(decode.tensor_parallel_size)]
    kv_senders = []
    try:
        prefill_address = ReplicaKVAddress(prefill, tuple(t.address for t in senders))
        decode_address = ReplicaKVAddress(decode, tuple(t.address for t in receivers))
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
        for t, cache, routes in zip(senders, prefill_caches, send_routes):
            kv_senders.append(KVSender(t, cache, lambda peer, routes=routes: routes))
        transfer_id = next(_ids)
        started = time.perf_counter()
        posted = [
            PostedReceive(t, cache, "P", transfer_id, DST_BLOCKS, layerwise, routes)
            for t, cache, routes in zip(receivers, decode_caches, recv_routes)
        ]
        jobs = [
            SendJob("r", "D", transfer_id, list(SRC_BLOCKS), layerwise, num_blocks=len(SRC_BLOCKS)) for _ in senders
        ]
        for sender, job in zip(kv_senders, jobs):
            sender.send_all(job)
        received = sum(p.complete(TIMEOUT_S)[0] for p in posted)
        for job in jobs:
            job.done.result(TIMEOUT_S)
        seconds = time.perf_counter() - started
        exact = all(
            torch.equal(got[:, :, DST_BLOCKS], want[:, :, SRC_BLOCKS]) and not got[:, :, [0, 5]].any()
            for cache, want_cache in zip(decode_caches, expected)
            for got, want in zip(_segments(cache), _segments(want_cache))
        )
        return {
            "exact": exact,
            "sent": sum(job.num_bytes for job in jobs),
            "received": received,
            "counted_sent": sum(t.stats().bytes_sent for t in senders),
            "counted_received": sum(t.stats().bytes_received for t in receivers),
            "one_one": len(SRC_BLOCKS) * whole.bytes_per_block,
            "replication": max(decode.tensor_parallel_size // decode.num_kv_heads, 1),
            "idle_prefill_ranks": [p for p, job in enumerate(jobs) if job.num_bytes == 0],
            "seconds": seconds,
        }
    finally:
        for sender in kv_senders:
            sender.close()
        for t in senders + receivers:
            t.close()


def check_tp_transfer(device: torch.device, tiny: bool) -> dict:
    model = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256,
        hidden_size=256 if tiny else 4096,
        intermediate_size=512,
        num_hidden_layers=2 if tiny else 8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16 if tiny else 128,
        max_position_embeddings=4096,
        dtype="bfloat16" if device.type == "cuda" else "float32",
    )
    same_device = "host" if device.type == "cuda" else "auto"
    items = []
    for kv_heads, a, b, kv_cache_dtype in ((4, 2, 1, "auto"), (4, 1, 2, "auto"), (4, 4, 2, "int8"), (1, 2, 1, "auto")):
        layouts = KVLayout(kv_heads, a), KVLayout(kv_heads, b)
        got = transfer_over_routes(
            dataclasses.replace(model, num_key_value_heads=kv_heads),
            *layouts,
            kv_cache_dtype,
            True,
            device,
            same_device,
        )
        bytes_ok = got["sent"] == got["received"] == got["counted_received"] == got["one_one"] * got["replication"]
        items.append(
            item(
                f"P/D {a}/{b}, {kv_heads} KV heads, {kv_cache_dtype} KV",
                "pass" if got["exact"] and bytes_ok else "fail",
                "each decode rank holds exactly its heads; bytes = the 1/1 figure"
                if got["exact"] and bytes_ok
                else f"exact={got['exact']}, bytes {got['received']} vs 1/1 {got['one_one']}",
                mib=got["received"] / 2**20,
                ms=got["seconds"] * 1e3,
            )
        )
    return {"items": items}
