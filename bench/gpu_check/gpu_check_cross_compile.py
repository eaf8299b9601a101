"""gpu_check check 2's CPU half: the Triton kernels compiled for sm_90 (Hopper) without a GPU
(decode attention single-pass and split, the split combine, block copies, LoRA)."""

from __future__ import annotations

from splitserve.bench.gpu_check.gpu_check_ops import item


def cross_compile() -> list[dict]:
    """Compile the kernels for sm_90 (Hopper) without a GPU, as launches on one would, so a
    kernel that cannot compile fails in CI and not first on a lent device. In a fresh process:
    interpreted launches leave triton.language patched in theirs (seen on Triton 3.9)."""
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_cross_compile_items).result(timeout=300)


# What a launch on the device specializes as divisible by 16 (so loads vectorize and pipeline):
# torch's tensor pointers, and the decode strides of a 16-token-block, head_dim-128 layer.
_DIVISIBLE_STRIDES = {f"stride_{name}" for name in "qb qh kblock koff khead vblock voff vhead ob oh".split()}


def _divisible_by_16(name: str) -> bool:
    return name.endswith("_ptr") or name in _DIVISIBLE_STRIDES


def _cross_compile_items() -> list[dict]:
    import os

    os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are imported in this process
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
    except ImportError as exc:
        return [item("compiles for sm_90", "info", f"this Triton cannot cross-compile: {exc}")]
    from splitserve.engine.ops import triton_decode_attention as decode
    from splitserve.engine.ops import triton_kernels as kernels

    decode_strides = "qb qh kblock koff khead vblock voff vhead sblock soff bt ob oh".split()
    decode_consts = dict(GROUP=4, BLOCK_G=16, BLOCK_SIZE=16, BLOCK_PAD=16, TILE_BLOCKS=4, HEAD_DIM=128, BLOCK_D=128)
    cases = {}
    # (q dtype, cache dtype, scales): 16/32-bit caches, and fp8 (bytes, bitcast) / int8 with float16 scales.
    for dtype, cache, scales in [(d, d, d) for d in ("bf16", "fp16", "fp32")] + [
        ("bf16", "u8", "fp16"),
        ("bf16", "i8", "fp16"),
    ]:
        signature = {"q_ptr": f"*{dtype}", "k_ptr": f"*{cache}", "v_ptr": f"*{cache}", "out_ptr": f"*{dtype}"}
        signature.update(k_scale_ptr=f"*{scales}", v_scale_ptr=f"*{scales}")
        signature.update(block_tables_ptr="*i32", context_lens_ptr="*i32", part_ptr="*fp32", scale="fp32")
        signature.update(window="i32", num_splits="i32")
        signature.update({f"stride_{name}": "i32" for name in decode_strides})
        quant = {"u8": "fp8 KV ", "i8": "int8 KV "}.get(cache, "")
        consts = {**decode_consts, "USE_DOT": True, "QUANT": bool(quant), "FP8": cache == "u8"}
        for split in (False, True):
            name = f"decode attention {quant}{dtype}{' split' if split else ''}"
            cases[name] = (decode._paged_decode_kernel, signature, {**consts, "SPLIT": split})
    # A small tile (head_dim 8, one 4-token block): the broadcast-sum path, split.
    small = {**decode_consts, "GROUP": 5, "BLOCK_G": 8, "BLOCK_SIZE": 4, "BLOCK_PAD": 4, "TILE_BLOCKS": 1}
    small.update(HEAD_DIM=8, BLOCK_D=8, USE_DOT=False, QUANT=False, FP8=False, SPLIT=True)
    cases["decode attention fp32 broadcast-sum split"] = (decode._paged_decode_kernel, signature, small)
    combine_signature = {
        "part_ptr": "*fp32",
        "out_ptr": "*bf16",
        "num_splits": "i32",
        "stride_ob": "i32",
        "stride_oh": "i32",
    }
    combine_consts = dict(HEAD_DIM=80, BLOCK_S=8, BLOCK_D=128)
    cases["decode split combine bf16"] = (decode._combine_splits_kernel, combine_signature, combine_consts)
    copy_args = "num_ids row_numel stride_src_plane stride_src_row stride_dst_plane stride_dst_row".split()
    copy_signature = {
        "src_ptr": "*bf16",
        "dst_ptr": "*bf16",
        "block_ids_ptr": "*i64",
        **dict.fromkeys(copy_args, "i32"),
    }
    for gather in (True, False):
        cases[f"block {'gather' if gather else 'scatter'} bf16"] = (
            kernels._copy_rows_kernel,
            copy_signature,
            dict(GATHER=gather, BLOCK=kernels._COPY_BLOCK),
        )
    from splitserve.bench.gpu_check.gpu_check_lora import compile_cases  # once TRITON_INTERPRET is unset

    cases.update(compile_cases())
    items = []
    for name, (kernel, signature, constants) in cases.items():
        fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # interpreted on CPU
        try:
            source = ASTSource(
                fn=fn,
                signature={**signature, **dict.fromkeys(constants, "constexpr")},
                constexprs={(fn.arg_names.index(key),): value for key, value in constants.items()},
                attrs={
                    (fn.arg_names.index(key),): [["tt.divisibility", 16]] for key in signature if _divisible_by_16(key)
                },
            )
        except TypeError as exc:  # another Triton's internal API: say so, do not fail
            items.append(item(f"{name} compiles for sm_90", "info", f"cannot cross-compile with this Triton: {exc}"))
            continue
        try:
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        except Exception as exc:
            items.append(item(f"{name} compiles for sm_90", "fail", f"{type(exc).__name__}: {exc}"[:2000]))
            continue
        numbers = {"cubin_bytes": len(compiled.asm["cubin"]), "shared_bytes": compiled.metadata.shared}
        # Async copies (cp.async) in the PTX: the loop's loads are software-pipelined.
        numbers["async_copies"] = compiled.asm["ptx"].count("cp.async")
        items.append(item(f"{name} compiles for sm_90", "pass", "cross-compiled, no GPU", **numbers))
    return items
