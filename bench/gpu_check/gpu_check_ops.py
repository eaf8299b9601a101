"""gpu_check checks 2 and 3: the Triton kernels, compiled, against torch; and their bandwidth.

Shapes are a Llama-3-8B-like layer: 32 query heads, 8 KV heads, head_dim 128, 16-token blocks.
Also the result-item and timing helpers the other gpu_check modules share.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
TARGET_FRACTION = 0.70  # of measured copy bandwidth, at batch >= 32 and context >= 4k
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # abs and rel


def item(name: str, status: str, note: str = "", **numbers) -> dict:
    """One line of a check: status pass | fail | missed (a speed target) | info."""
    return {"name": name, "status": status, "note": note, "numbers": numbers}


def time_ms(fn, device: torch.device, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn(): CUDA events per call on a GPU, the host clock on CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def paged_problem(context_lens: list[int], dtype: torch.dtype, device: torch.device, seed: int):
    """q, key/value caches with every sequence's blocks scattered at random, tables, lengths."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = [math.ceil(n / BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    value_cache = torch.randn(shape, generator=gen, device=device).to(dtype)
    q = torch.randn(len(context_lens), NUM_Q_HEADS, HEAD_DIM, generator=gen, device=device).to(dtype)
    physical = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros(len(context_lens), max(blocks), dtype=torch.int32, device=device)
    cursor = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = physical[cursor : cursor + count]
        cursor += count
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, key_cache, value_cache, tables, lens


def _attention_cases(tiny: bool) -> list[tuple[int, int, torch.dtype]]:
    if tiny:  # fp16, not bf16: the Triton interpreter's bf16 tl.dot is wrong (seen on Triton 3.9)
        return [(1, 70, torch.float32), (3, 40, torch.float16)]
    return [
        (1, 32768, torch.bfloat16),
        (32, 4096, torch.bfloat16),
        (64, 8192, torch.float16),
        (256, 512, torch.bfloat16),
        (16, 2048, torch.float32),
    ]


def check_kernels(device: torch.device, tiny: bool) -> dict:
    """Paged decode attention and block gather/scatter against the torch paths, with ragged
    contexts and shuffled blocks; on a GPU the kernels must be compiled, not interpreted."""
    from splitserve.engine.ops import attention, block_copy, triton_decode_attention
    from splitserve.engine.ops import triton_kernels as kernels

    mode = (
        "interpreted"
        if type(triton_decode_attention._paged_decode_kernel).__name__ == "InterpretedFunction"
        else "compiled"
    )
    wanted = "interpreted" if device.type == "cpu" else "compiled"
    items = [item("triton mode", "pass" if mode == wanted else "fail", f"{mode}; expected {wanted} on {device.type}")]
    for index, (batch, context, dtype) in enumerate(_attention_cases(tiny)):
        gen = torch.Generator().manual_seed(index)
        lens = [context] + [
            1 + int(torch.randint(context // 2, context, (1,), generator=gen)) for _ in range(batch - 1)
        ]
        if batch > 2:
            lens[1] = 1  # a one-token context
        q, key_cache, value_cache, tables, lens_t = paged_problem(lens, dtype, device, seed=index)
        scale = HEAD_DIM**-0.5
        out = torch.full_like(q, float("nan"))  # every element must be written
        triton_decode_attention.paged_decode_attention(q, key_cache, value_cache, tables, lens_t, scale, out=out)
        reference = attention.paged_decode_attention_torch(
            q.float(), key_cache.float(), value_cache.float(), tables, lens_t, scale, max(lens)
        )
        error = (out.float() - reference).abs().max().item()
        # The split-context path forced (whatever the automatic choice), and the single pass.
        for forced in (1, 5):
            forced_out = triton_decode_attention.paged_decode_attention(
                q, key_cache, value_cache, tables, lens_t, scale, num_splits=forced
            )
            error = max(error, (forced_out.float() - reference).abs().max().item())
        limit = TOLERANCE[dtype] * (1 + reference.abs().max().item())
        dispatched = torch.equal(
            attention.decode_attention(q, key_cache, value_cache, tables, lens_t, scale, max(lens)), out
        )
        ok = error <= limit and not out.isnan().any().item() and (dispatched or device.type == "cpu")
        note = "decode_attention dispatches to it" if dispatched else "decode_attention takes the torch path"
        items.append(
            item(
                f"decode attention b={batch} ctx<={context} {str(dtype)[6:]}",
                "pass" if ok else "fail",
                f"{note}; also with 1 and 5 context splits",
                max_abs_error=error,
                tolerance=limit,
            )
        )
    row_numel = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
    num_blocks, counts = (16, [1, 5]) if tiny else (8192, [1, 37, 2048])
    gen = torch.Generator(device=device).manual_seed(7)
    planes = torch.randn(2, num_blocks, row_numel, generator=gen, device=device).to(torch.bfloat16)
    for count in counts:
        for id_dtype in (torch.int32, torch.int64):
            ids = torch.randperm(num_blocks, generator=gen, device=device)[:count].to(id_dtype)
            packed = torch.full((2, count, row_numel), float("nan"), dtype=planes.dtype, device=device)
            kernels.gather_blocks(planes, ids, packed)
            gathered = torch.equal(packed, planes.index_select(1, ids.long()))
            restored = torch.zeros_like(planes)
            kernels.scatter_blocks(packed, restored, ids)
            expected = torch.zeros_like(planes).index_copy_(1, ids.long(), packed)
            scattered = torch.equal(restored, expected)
            via_engine = torch.equal(block_copy.gather_blocks(planes, ids), packed)
            ok = gathered and scattered and via_engine
            items.append(
                item(
                    f"gather/scatter n={count} ids {str(id_dtype)[6:]}",
                    "pass" if ok else "fail",
                    f"gather exact {gathered}, scatter exact {scattered}, block_copy agrees {via_engine}",
                )
            )
    if device.type == "cpu":
        from splitserve.bench.gpu_check.gpu_check_cross_compile import cross_compile

        items += cross_compile()
    return {"items": items}


def copy_bandwidth(device: torch.device, tiny: bool) -> float:
    """Bytes read + written per second by a device-to-device copy of a large buffer."""
    numel = (8 if tiny else 512) * 2**20  # bf16: 16 MiB or 1 GiB
    src = torch.randn(numel, device=device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=5 if tiny else 20)
    return 2 * src.nbytes / (ms / 1e3)


def _bandwidth_cases(tiny: bool) -> list[tuple[int, int]]:
    if tiny:
        return [(2, 48)]
    return [(1, 32768), (8, 32768), (32, 4096), (64, 4096), (128, 4096), (256, 4096), (32, 16384), (256, 8192)]


def _target_status(achieved: float, copy_bw: float, applies: bool, device: torch.device) -> str:
    if device.type != "cuda" or not applies:
        return "info"
    return "pass" if achieved >= TARGET_FRACTION * copy_bw else "missed"


def _split_sweep(device: torch.device, tiny: bool, dtype: torch.dtype, timing: dict) -> list[dict]:
    """The kernel's ms at forced context-split counts, per shape: what choose_num_splits is tuned by."""
    from splitserve.engine.ops import triton_decode_attention as decode

    items = []
    for batch, context in [(2, 64)] if tiny else [(32, 4096), (64, 4096), (8, 32768)]:
        q, key_cache, value_cache, tables, lens = paged_problem([context] * batch, dtype, device, seed=7)
        scale, out = HEAD_DIM**-0.5, torch.empty_like(q)
        call = functools.partial(decode.paged_decode_attention, q, key_cache, value_cache, tables, lens, scale, out)
        ms = {
            splits: time_ms(lambda n=splits, c=call: c(num_splits=n), device, **timing)
            for splits in ((1, 2) if tiny else (1, 2, 3, 5, 8, 12, 16, 24, 32))
        }
        best = min(ms, key=ms.__getitem__)
        note = ", ".join(f"{n}: {t:.3f} ms" for n, t in ms.items())
        items.append(item(f"decode attention split sweep b={batch} ctx={context}", "info", note, fastest_splits=best))
    return items


def _attention_speed(batch: int, context: int, dtype: torch.dtype, device: torch.device, timing: dict, seed: int):
    """(K/V bytes, kernel ms, SDPA ms) for batch sequences of exactly context tokens."""
    import torch.nn.functional as F

    from splitserve.engine.ops import triton_decode_attention as decode

    q, key_cache, value_cache, tables, lens = paged_problem([context] * batch, dtype, device, seed)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    out, scale = torch.empty_like(q), HEAD_DIM**-0.5
    # As the engine calls it: the context split chosen from the shapes.
    ms = time_ms(
        lambda: decode.paged_decode_attention(q, key_cache, value_cache, tables, lens, scale, out), device, **timing
    )
    # The same K/V laid out contiguously per sequence, [B, kv_heads, ctx, D], queries grouped per KV head.
    keys = key_cache[tables.long()].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    key_cache = None
    values = (
        value_cache[tables.long()].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
    )
    value_cache = None
    q4 = q.view(batch, NUM_KV_HEADS, NUM_Q_HEADS // NUM_KV_HEADS, HEAD_DIM)
    sdpa_ms = time_ms(lambda: F.scaled_dot_product_attention(q4, keys, values, scale=scale), device, **timing)
    return kv_bytes, ms, sdpa_ms


def check_bandwidth(device: torch.device, tiny: bool) -> dict:
    """K/V bytes read per second by paged decode attention (vs copy bandwidth and SDPA on
    contiguous K/V), and bytes moved per second by block gather/scatter."""
    from splitserve.engine.ops import triton_decode_attention as decode
    from splitserve.engine.ops import triton_kernels as kernels

    copy_bw = copy_bandwidth(device, tiny)
    items = [item("device copy (read + write)", "info", "the ceiling the targets refer to", gb_per_s=copy_bw / 1e9)]
    timing = {"reps": 1, "warmup": 0} if tiny else {"reps": 20, "warmup": 3}
    dtype = torch.float16 if tiny else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong (Triton 3.9)
    for index, (batch, context) in enumerate(_bandwidth_cases(tiny)):
        kv_bytes, ms, sdpa_ms = _attention_speed(batch, context, dtype, device, timing, seed=100 + index)
        achieved = kv_bytes / (ms / 1e3)
        applies = batch >= 32 and context >= 4096
        table_tokens = -(-context // BLOCK_SIZE) * BLOCK_SIZE
        splits = decode.choose_num_splits(batch, NUM_KV_HEADS, table_tokens, decode.multiprocessors(device))
        items.append(
            item(
                f"decode attention b={batch} ctx={context}",
                _target_status(achieved, copy_bw, applies, device),
                "target >= 70% of copy" if applies else "no target at this shape",
                ms=ms,
                context_splits=splits,
                kv_gb_per_s=achieved / 1e9,
                of_copy=achieved / copy_bw,
                sdpa_ms=sdpa_ms,
                sdpa_gb_per_s=kv_bytes / (sdpa_ms / 1e3) / 1e9,
            )
        )
    items += _split_sweep(device, tiny, dtype, timing)
    row_numel = BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM
    num_blocks, count = (8, 2) if tiny else (16384, 4096)
    planes = torch.randn(2, num_blocks, row_numel, device=device).to(dtype)
    ids = torch.randperm(num_blocks, device=device)[:count]
    packed = torch.empty(2, count, row_numel, dtype=dtype, device=device)
    moved = 2 * packed.nbytes  # read + written, as for the copy
    copies = {
        "gather": lambda: kernels.gather_blocks(planes, ids, packed),
        "scatter": lambda: kernels.scatter_blocks(packed, planes, ids),
    }
    for name, fn in copies.items():
        ms = time_ms(fn, device, **timing)
        achieved = moved / (ms / 1e3)
        items.append(
            item(
                f"block {name} {count} of {num_blocks} blocks",
                _target_status(achieved, copy_bw, True, device),
                "target >= 70% of copy",
                ms=ms,
                gb_per_s=achieved / 1e9,
                of_copy=achieved / copy_bw,
            )
        )
    return {"items": items, "copy_gb_per_s": copy_bw / 1e9}
