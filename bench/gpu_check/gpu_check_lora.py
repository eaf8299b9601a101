"""gpu_check check 13: the Triton LoRA kernels (engine/ops/triton_lora.py) against the torch path.

A Llama-3-8B-like layer (hidden 4096, 32 query and 8 KV heads of 128, intermediate 14336), 8
adapter slots of rank 16, every projection group targeted. Steps mix the adapters and the base:
a decode step of 1, 64 and 256 tokens (a token per sequence, adapters in turn, every fourth
sequence the base) and a prefill of 8 prompts of 256 tokens over 4 adapters and the base. For
each, in bf16 and fp16, engine/lora/lora_batch.py's delta through the kernels (what CUDA runs)
and through its torch layouts, both against the torch path in fp32 (relative max error; base
tokens must get exact zeros), then both timed over the four groups of one layer. Where the
slots are on CUDA, LoraBatch must pick the kernels by itself.
"""

from __future__ import annotations

import torch

from splitserve.bench.gpu_check.gpu_check_ops import item, time_ms
from splitserve.engine.lora.lora_batch import KERNEL, KERNEL_MAX_TOKENS, LoraBatch
from splitserve.engine.lora.lora_slots import PROJECTION_GROUPS, LoraSlots
from splitserve.engine.model_config import ModelConfig

SLOTS, RANK = 8, 16
# Relative to the largest delta: the kernels accumulate in fp32, the torch path in 16 bits.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _config(tiny: bool) -> ModelConfig:
    if tiny:
        return ModelConfig("LlamaForCausalLM", 100, 64, 96, 1, 4, 2, 16, 128)
    return ModelConfig("LlamaForCausalLM", 128256, 4096, 14336, 1, 32, 8, 128, 8192)


def _steps(tiny: bool) -> dict[str, tuple[list[int | None], list[int]]]:
    """name -> (each sequence's slot, None for the base; its tokens in the step)."""

    def decode(n: int) -> tuple[list[int | None], list[int]]:
        return [None if i % 4 == 3 else i % SLOTS for i in range(n)], [1] * n

    if tiny:
        return {"decode 5": decode(5), "prefill 3x6": ([1, None, 3], [6, 6, 6])}
    prefill = ([i % 4 if i % 5 != 4 else None for i in range(8)], [256] * 8)
    return {"decode 1": decode(1), "decode 64": decode(64), "decode 256": decode(256), "prefill 8x256": prefill}


def _slots(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> LoraSlots:
    """Slots with random A and B for every target (A scaled so a delta is about N(0, 1))."""
    slots = LoraSlots(config, SLOTS, RANK, dtype, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for targets in PROJECTION_GROUPS.values():
        for target in targets:
            a, b = slots._stacks(target)
            a.copy_(torch.randn(a.shape, generator=gen) / a.shape[-1] ** 0.5)
            b.copy_(torch.randn(b.shape, generator=gen) / RANK**0.5)
    scaling = torch.rand(SLOTS, generator=gen) + 0.5
    slots.scaling.copy_(scaling)
    slots.slot_scaling = scaling.tolist()
    return slots


def _as(slots: LoraSlots, dtype: torch.dtype) -> LoraSlots:
    """The same adapters in another dtype (the fp32 reference's)."""
    other = LoraSlots(slots.config, SLOTS, RANK, dtype, slots.device)
    for targets in PROJECTION_GROUPS.values():
        for target in targets:
            a, b = other._stacks(target)
            a.copy_(slots.a[target])
            b.copy_(slots.b[target])
    other.scaling.copy_(slots.scaling)
    other.slot_scaling = list(slots.slot_scaling)
    return other


def compile_cases() -> dict[str, tuple]:
    """The LoRA kernels as gpu_check_cross_compile.cross_compile compiles them for sm_90 without a GPU:
    name -> (kernel, signature, constexprs), bf16 and fp16, at the layer's tile sizes."""
    from splitserve.engine.ops import triton_lora

    cases = {}
    for dtype in ("bf16", "fp16"):
        shrink = {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "slots_ptr": "*i32", "out_ptr": "*fp32"}
        shrink.update(dict.fromkeys("in_dim cols stride_xt stride_as stride_ak stride_an stride_ot".split(), "i32"))
        consts = dict(BLOCK_K=triton_lora._BLOCK_K, BLOCK_N=triton_lora._BLOCK_N)
        cases[f"lora shrink {dtype}"] = (triton_lora._lora_shrink_kernel, shrink, consts)
        expand = {"s_ptr": "*fp32", "b_ptr": f"*{dtype}", "slots_ptr": "*i32", "scaling_ptr": f"*{dtype}"}
        expand.update(out_ptr=f"*{dtype}")
        expand.update(dict.fromkeys("rank cols stride_st stride_bs stride_br stride_bn stride_ot".split(), "i32"))
        consts = dict(BLOCK_R=RANK, BLOCK_N=triton_lora._BLOCK_N)
        cases[f"lora expand {dtype}"] = (triton_lora._lora_expand_kernel, expand, consts)
    return cases


def _deltas(batch: LoraBatch, inputs: dict[str, torch.Tensor], widths: dict[str, int]) -> dict[str, torch.Tensor]:
    outs = {}
    for group, x in inputs.items():
        outs[group] = torch.zeros(x.shape[0], widths[group], dtype=x.dtype, device=x.device)
        batch.add_delta(outs[group], 0, group, x)
    return outs


def _relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[g].float() - want[g]).abs().max() / want[g].abs().max()) for g in want)


def check_lora(device: torch.device, tiny: bool) -> dict:
    from splitserve.engine.ops import triton_lora

    mode = "interpreted" if type(triton_lora._lora_shrink_kernel).__name__ == "InterpretedFunction" else "compiled"
    wanted = "interpreted" if device.type == "cpu" else "compiled"
    items = [item("triton mode", "pass" if mode == wanted else "fail", f"{mode}; expected {wanted} on {device.type}")]
    config = _config(tiny)
    dtypes = (torch.float16, torch.bfloat16)
    reps = dict(reps=1, warmup=0) if tiny else {}  # tiny: only that the timing runs
    for index, dtype in enumerate(dtypes):
        slots = _slots(config, dtype, device, seed=index)
        reference_slots = _as(slots, torch.float32)
        widths = {group: sum(w for _, _, w in slots.columns[group]) for group in PROJECTION_GROUPS}
        auto = LoraBatch(slots, [0], [1])
        long = LoraBatch(slots, [0], [KERNEL_MAX_TOKENS + 1])  # past it: a torch layout everywhere
        expected_layout = KERNEL if device.type == "cuda" else "a torch layout"
        picked = (auto.layout == KERNEL) == (device.type == "cuda") and long.layout != KERNEL
        items.append(
            item(
                f"{str(dtype)[6:]} dispatch",
                "pass" if picked else "fail",
                f"1 token: {auto.layout}, expected {expected_layout}; {KERNEL_MAX_TOKENS + 1} tokens: {long.layout}",
            )
        )
        gen = torch.Generator(device="cpu").manual_seed(10 + index)
        for name, (seq_slots, num_tokens) in _steps(tiny).items():
            tokens = sum(num_tokens)
            inputs = {
                group: torch.randn(tokens, slots.a_t[group].shape[2], generator=gen).to(device, dtype)
                for group in PROJECTION_GROUPS
            }
            kernel = LoraBatch(slots, seq_slots, num_tokens, use_kernel=True)
            torch_batch = LoraBatch(slots, seq_slots, num_tokens, use_kernel=False)
            reference = _deltas(
                LoraBatch(reference_slots, seq_slots, num_tokens, use_kernel=False),
                {g: x.float() for g, x in inputs.items()},
                widths,
            )
            got, torch_got = _deltas(kernel, inputs, widths), _deltas(torch_batch, inputs, widths)
            base_rows = torch.tensor(
                [
                    t
                    for t, slot in enumerate(s for s, n in zip(seq_slots, num_tokens) for _ in range(n))
                    if slot is None
                ],
                dtype=torch.int64,
                device=device,
            )
            base_zero = all(not got[g].index_select(0, base_rows).any().item() for g in got)
            error, torch_error = _relative(got, reference), _relative(torch_got, reference)
            kernel_ms = time_ms(lambda b=kernel, x=inputs, w=widths: _deltas(b, x, w), device, **reps)
            torch_ms = time_ms(lambda b=torch_batch, x=inputs, w=widths: _deltas(b, x, w), device, **reps)
            ok = error <= TOLERANCE[dtype] and base_zero
            items.append(
                item(
                    f"{name} {str(dtype)[6:]}",
                    "pass" if ok else "fail",
                    f"vs fp32 torch <= {TOLERANCE[dtype]}, base tokens exact zeros: {base_zero}; "
                    f"torch path layout {torch_batch.layout}",
                    err_kernel=error,
                    err_torch=torch_error,
                    kernel_ms=kernel_ms,
                    torch_ms=torch_ms,
                    speedup_vs_torch=torch_ms / kernel_ms,
                )
            )
    return {"items": items}
