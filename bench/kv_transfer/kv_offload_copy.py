"""Host KV tier micro-measurements on this machine (engine/ops/host_kv_cache.py):

1. the unit of a copy: saving / loading N blocks as one contiguous block-major copy (all
   layers of a block together: what HostKVCache does) vs one copy per block per layer into a
   layer-major host tensor (the device cache's own layout);
2. the router's host_hit_weight: loading a block from the host tier vs recomputing it (one
   prefill of the same prompt on the same engine), per block: weight = 1 - load / recompute.

    python -m splitserve.bench.kv_transfer.kv_offload_copy --model DIR [--blocks 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.ops.host_kv_cache import HostKVCache
from splitserve.proto.messages.sampling_params import SamplingParams


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_units(engine: LLMEngine, num_blocks: int, repeats: int) -> dict[str, float]:
    """Seconds per block: contiguous (block-major) vs per-layer copies, save and load."""
    cache = engine.kv_cache
    host = HostKVCache(cache, num_blocks)
    blocks, slots = list(range(num_blocks)), list(range(num_blocks))
    layer_major = torch.zeros(cache.num_layers, 2, num_blocks, cache.kv[0, 0, 0].numel(), dtype=cache.dtype)

    def per_layer_save():
        for layer in range(cache.num_layers):
            planes = cache.layer_planes(layer)
            for b, s in zip(blocks, slots):
                layer_major[layer, :, s].copy_(planes[:, b])

    def per_layer_load():
        for layer in range(cache.num_layers):
            planes = cache.layer_planes(layer)
            for b, s in zip(blocks, slots):
                planes[:, b].copy_(layer_major[layer, :, s])

    return {
        "save contiguous": _best(lambda: host.save(blocks, slots), repeats) / num_blocks,
        "save per layer": _best(per_layer_save, repeats) / num_blocks,
        "load contiguous": _best(lambda: host.load(slots, blocks), repeats) / num_blocks,
        "load per layer": _best(per_layer_load, repeats) / num_blocks,
    }


def recompute_per_block(engine: LLMEngine, num_blocks: int, repeats: int) -> float:
    """Seconds per block to prefill a num_blocks-block prompt from scratch (no cache hit)."""
    bs = engine.config.block_size
    params = SamplingParams(temperature=0, max_tokens=1)
    calls = [0]

    def prefill():
        calls[0] += 1  # a fresh prompt each time (the engine runs without prefix caching anyway)
        ids = [(calls[0] * 7919 + 31 * i) % 1900 + 20 for i in range(num_blocks * bs + 1)]
        engine.generate([ids], params)

    prefill()  # warm up
    return _best(prefill, repeats) / num_blocks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, num_kv_blocks=args.blocks * 2 + 2, enable_prefix_caching=False))
    units = copy_units(engine, args.blocks, args.repeats)
    recompute = recompute_per_block(engine, args.blocks, args.repeats)
    bpb = engine.kv_cache.bytes_per_block
    print(f"model {args.model}: {engine.kv_cache.num_layers} layers, {bpb} bytes per block, {args.blocks} blocks")
    print("| what | us per block | |")
    print("|---|---|---|")
    for name in ("save", "load"):
        contiguous, per_layer = units[f"{name} contiguous"], units[f"{name} per layer"]
        print(f"| {name}: contiguous block-major | {contiguous * 1e6:.1f} | {per_layer / contiguous:.1f}x faster |")
        print(f"| {name}: per block per layer | {per_layer * 1e6:.1f} | |")
    print(f"| recompute (prefill) | {recompute * 1e6:.1f} | |")
    load = units["load contiguous"]
    print(f"load / recompute = {load / recompute:.4f}; host_hit_weight = 1 - that = {1 - load / recompute:.3f}")


if __name__ == "__main__":
    main()
