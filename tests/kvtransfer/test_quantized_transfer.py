"""An fp8/int8 KV cache over a real pair (two endpoints in this process; gloo and the same-device
ipc and host channels): the handoff moves the 8-bit values and their scales as stored (not a
dequantized copy), byte for byte, and about half the bytes of a 16-bit cache's handoff --
asserted from the transports' TransferStats."""

from __future__ import annotations

import itertools

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_sizing import kv_bytes_per_block
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer.kv_receiver import PostedReceive
from splitserve.kvtransfer.kv_sender import KVSender, SendJob
from tests.helpers.paired_transports import CHANNEL_OF, SAME_DEVICE, paired_transports

NUM_BLOCKS = 12
TIMEOUT_S = 10.0
SRC_IDS, DST_IDS = [7, 1, 10, 4, 5], [0, 1, 2, 9, 3]  # scattered -> partly a run
_transfer_ids = itertools.count(1)


@pytest.fixture(scope="module", params=SAME_DEVICE, ids=CHANNEL_OF.get)
def pair(request):
    with paired_transports("q", request.param, TIMEOUT_S) as endpoints:
        yield endpoints


def _cache(model_dir: str, kv_cache_dtype: str, dtype: str) -> KVCache:
    config = EngineConfig(model=model_dir, num_kv_blocks=NUM_BLOCKS, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    return KVCache(ModelConfig.from_pretrained(model_dir), config)


def _filled(model_dir: str, kv_cache_dtype: str, dtype: str) -> KVCache:
    """A cache whose every slot of every layer holds quantized (or plain) random K/V."""
    cache = _cache(model_dir, kv_cache_dtype, dtype)
    generator = torch.Generator().manual_seed(4)
    slots = torch.arange(NUM_BLOCKS * cache.block_size)
    for layer in range(cache.num_layers):
        for plane in (cache.key_cache(layer), cache.value_cache(layer)):
            x = torch.randn(len(slots), cache.num_kv_heads, cache.head_dim, generator=generator) * 3
            if cache.quantized:
                plane.write(x, slots)
            else:
                plane.view(-1, cache.num_kv_heads, cache.head_dim).copy_(x)
    return cache


def _handoff(pair, model_dir: str, kv_cache_dtype: str, dtype: str, layerwise: bool) -> tuple[int, KVCache, KVCache]:
    """Bytes the sender's and receiver's transport counters grew by for one handoff of SRC_IDS."""
    prefill, decode = pair
    source, target = _filled(model_dir, kv_cache_dtype, dtype), _cache(model_dir, kv_cache_dtype, dtype)
    target.kv.share_memory_()  # the ipc channel writes into receive buffers in shared memory
    sent_before, received_before = prefill.stats().bytes_sent, decode.stats().bytes_received
    sender = KVSender(prefill, source)
    try:
        transfer_id = next(_transfer_ids)
        posted = PostedReceive(decode, target, "q-prefill", transfer_id, DST_IDS, layerwise)
        job = SendJob(f"req-{transfer_id}", "q-decode", transfer_id, SRC_IDS, layerwise)
        sender.send_all(job)
        posted.complete(TIMEOUT_S)
        assert job.done.result(TIMEOUT_S) is job
    finally:
        sender.close()
    sent = prefill.stats().bytes_sent - sent_before
    assert decode.stats().bytes_received - received_before == sent
    return sent, source, target


@pytest.mark.parametrize("layerwise", [False, True], ids=["packed", "layerwise"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_blocks_and_scales_arrive_as_stored(pair, tiny_model, kv_cache_dtype, layerwise):
    sent, source, target = _handoff(pair, tiny_model, kv_cache_dtype, "float32", layerwise)
    assert sent == len(SRC_IDS) * source.bytes_per_block
    assert torch.equal(target.kv[:, :, DST_IDS], source.kv[:, :, SRC_IDS])  # values + scales, bytes
    for layer in range(source.num_layers):  # and they read back as the same K/V
        got = target.key_cache(layer).gather(torch.tensor(DST_IDS), torch.float32)
        assert torch.equal(got, source.key_cache(layer).gather(torch.tensor(SRC_IDS), torch.float32))
    untouched = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    assert not target.kv[:, :, untouched].any()


def test_fp8_handoff_moves_about_half_the_bytes_of_a_16_bit_one(pair, tiny_model):
    moved = {
        (kv, dtype): _handoff(pair, tiny_model, kv, dtype, layerwise=True)[0]
        for kv, dtype in (("auto", "bfloat16"), ("auto", "float32"), ("fp8", "bfloat16"), ("int8", "bfloat16"))
    }
    model = ModelConfig.from_pretrained(tiny_model)
    head_dim = model.head_dim  # 16 in the tiny preset: a float16 scale per head_dim bytes is 1/8 more
    fp8_vs_bf16 = moved[("fp8", "bfloat16")] / moved[("auto", "bfloat16")]
    assert fp8_vs_bf16 == pytest.approx((head_dim + 2) / (2 * head_dim))  # 0.5625 here, 0.516 at head_dim 64
    assert fp8_vs_bf16 <= 0.57
    assert moved[("int8", "bfloat16")] == moved[("fp8", "bfloat16")]
    assert moved[("fp8", "bfloat16")] / moved[("auto", "float32")] == pytest.approx((head_dim + 2) / (4 * head_dim))
    assert moved[("auto", "bfloat16")] == len(SRC_IDS) * kv_bytes_per_block(model, 16, "auto", "bfloat16")
