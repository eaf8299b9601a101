"""gpu_check check 6: the host KV tier (kv_offloading_size) on the device.

copy        HostKVCache save -> load round trip is bit-exact; on CUDA the host tensor is
            pinned and the copies run on the side stream (the compute stream waits for them)
bandwidth   save and load throughput in GB/s (one contiguous copy per block, all layers), and
            load vs recompute per block: the router's host_hit_weight = 1 - load / recompute
engine      a multi-turn workload on a device pool too small for it: greedy tokens equal to an
            engine whose device pool holds it all, with blocks loaded back from host memory (the
            same KV bits either way; an engine that recomputes what it evicted rounds differently
            in 16 bits, and its greedy tokens drift: the first H200 run saw that)
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from splitserve.bench.gpu_check.gpu_check_ops import item
from splitserve.bench.gpu_check.gpu_check_throughput import TINY, write_llama

SMALL = dict(TINY, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_key_value_heads=4, head_dim=64)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine(model_dir: Path, device: torch.device, num_kv_blocks: int, tier_gib: float):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(model=str(model_dir), num_kv_blocks=num_kv_blocks, device=device.type, kv_offloading_size=tier_gib)
    )


def _copy_items(engine, device: torch.device, num_blocks: int) -> tuple[list[dict], float]:
    from splitserve.engine.ops.host_kv_cache import HostKVCache

    cache = engine.kv_cache
    host = HostKVCache(cache, num_blocks)
    src, dst = list(range(num_blocks)), list(range(num_blocks, 2 * num_blocks))
    cache.kv.normal_()
    host.save(src, list(range(num_blocks)))
    host.load(list(range(num_blocks)), dst)
    _sync(device)
    exact = torch.equal(cache.kv[:, :, src], cache.kv[:, :, dst])
    pinned = host.host.is_pinned() if device.type == "cuda" else True
    items = [
        item(
            "save/load round trip",
            "pass" if exact and pinned else "fail",
            f"{num_blocks} blocks, bit-exact={exact}, pinned host={pinned}, side stream={host._stream is not None}",
        )
    ]
    nbytes = num_blocks * cache.bytes_per_block
    seconds = {}
    for name, fn in (
        ("save", lambda: host.save(src, list(range(num_blocks)))),
        ("load", lambda: host.load(list(range(num_blocks)), dst)),
    ):
        fn()
        _sync(device)
        start = time.perf_counter()
        for _ in range(5):
            fn()
        _sync(device)
        seconds[name] = (time.perf_counter() - start) / 5
        items.append(
            item(
                f"{name} bandwidth",
                "info",
                "one copy per block",
                gb_per_s=nbytes / seconds[name] / 1e9,
                blocks=num_blocks,
            )
        )
    return items, seconds["load"] / num_blocks


def _recompute_per_block(engine, num_blocks: int, device: torch.device) -> float:
    from splitserve.proto.messages.sampling_params import SamplingParams

    bs = engine.config.block_size
    params = SamplingParams(temperature=0, max_tokens=1)
    # Fill num_blocks blocks, less one token where the model's context is exactly that long
    # (prompt plus the one sampled token must fit it).
    length = min(num_blocks * bs, engine.max_model_len - 1)
    ids = [(31 * i) % 400 + 20 for i in range(length)]
    engine.generate([ids], params)  # warm-up
    _sync(device)
    start = time.perf_counter()
    engine.generate([[t + 1 for t in ids]], params)
    _sync(device)
    return (time.perf_counter() - start) / num_blocks


def _chat(engine, num_convs: int, num_turns: int) -> list[list[int]]:
    from splitserve.proto.messages.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    history = {c: [(5 * i) % 300 + 40 for i in range(24)] for c in range(num_convs)}
    outputs = []
    for turn in range(num_turns):
        for c in range(num_convs):
            history[c] += [(11 * c + 7 * turn + 3 * i) % 300 + 60 for i in range(20)]
            out = engine.generate([history[c]], greedy)[0].token_ids
            history[c] += out
            outputs.append(out)
    return outputs


def check_offload(device: torch.device, tiny: bool, work: Path) -> dict:
    model_dir, _ = write_llama(work / "offload-model", TINY if tiny else SMALL, device)
    num_blocks = 16 if tiny else 256
    sizing = _engine(model_dir, device, 2 * num_blocks + 2, 0.0)
    items, load_per_block = _copy_items(sizing, device, num_blocks)
    recompute = _recompute_per_block(sizing, num_blocks, device)
    items.append(
        item(
            "load vs recompute",
            "info",
            "RouterConfig.host_hit_weight = 1 - load / recompute per block",
            load_us=load_per_block * 1e6,
            recompute_us=recompute * 1e6,
            host_hit_weight=1 - load_per_block / recompute,
        )
    )
    del sizing
    tier = 64 * 1e6 / 2**30  # 64 MB: the whole workload fits
    roomy, tiered = _engine(model_dir, device, 64, 0.0), _engine(model_dir, device, 12, tier)
    same = _chat(roomy, 5, 3) == _chat(tiered, 5, 3)
    stats = tiered.stats()
    ok = same and stats.host_loaded_blocks > 0 and stats.num_free_blocks == stats.num_blocks
    items.append(
        item(
            "multi-turn greedy with the tier",
            "pass" if ok else "fail",
            f"identical to a device pool that holds it all: {same}",
            loaded_blocks=stats.host_loaded_blocks,
            stored_blocks=stats.host_stored_blocks,
            load_ms_mean=1e3 * stats.host_load_seconds / max(stats.host_loads, 1),
        )
    )
    return {"items": items}
