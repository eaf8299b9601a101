"""The Triton LoRA kernels' interpreter checks (engine/ops/triton_lora.py), against torch: the
case functions in tests/helpers/triton_cases.py call these (with TRITON_INTERPRET=1 set)."""

from __future__ import annotations

import torch

# As triton_cases.py's: fp32 exact to rounding, 16-bit to their output rounding.
_DTYPE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def reference_lora_delta(x, a_t, b, token_slots, scaling):
    """Token by token in fp64: scaling[slot] * (x[t] @ a_t[slot]) @ b[slot]; zeros for slot -1."""
    delta = torch.zeros(x.shape[0], b.shape[2], dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            delta[t] = (x[t].double() @ a_t[slot].double()) @ b[slot].double() * float(scaling[slot])
    return delta


def lora_problem(tokens, slots, in_dim, rank, out_dim, dtype, seed, token_slots):
    """x, a_t [slots, in, rank], b [slots, rank, out], scaling per slot and the int32 token slots."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_dim, generator=generator).to(dtype)
    a_t = (torch.randn(slots, in_dim, rank, generator=generator) / in_dim**0.5).to(dtype)
    b = torch.randn(slots, rank, out_dim, generator=generator).to(dtype)
    scaling = (torch.rand(slots, generator=generator) + 0.5).to(dtype)
    return x, a_t, b, scaling, torch.tensor(token_slots, dtype=torch.int32)


def check_lora(dtype, rank, in_dim=24, out_dim=40, slot_of_tokens=(0, -1, 2, 2, 1, -1, 0)):
    """Shrink then expand into a column slice of a bigger output: each token gets its own
    slot's delta, a base token (-1) none, and the columns outside the slice are untouched."""
    from splitserve.engine.ops.triton_lora import lora_expand, lora_shrink

    x, a_t, b, scaling, token_slots = lora_problem(
        len(slot_of_tokens), 3, in_dim, rank, out_dim, dtype, seed=rank, token_slots=list(slot_of_tokens)
    )
    shrunk = lora_shrink(x, a_t, token_slots)
    assert shrunk.dtype == torch.float32 and shrunk.shape == (len(slot_of_tokens), rank)
    before = torch.randn(len(slot_of_tokens), out_dim + 8, generator=torch.Generator().manual_seed(9)).to(dtype)
    out = before.clone()
    lora_expand(shrunk, b, token_slots, scaling, out[:, 5 : 5 + out_dim])
    expected = before[:, 5 : 5 + out_dim].double() + reference_lora_delta(x, a_t, b, token_slots, scaling)
    tolerance = _DTYPE_TOLERANCE[dtype] * (1 + expected.abs().max().item())
    error = (out[:, 5 : 5 + out_dim].double() - expected).abs().max().item()
    assert error <= tolerance, f"max abs error {error} > {tolerance}"
    assert torch.equal(out[:, :5], before[:, :5]) and torch.equal(out[:, 5 + out_dim :], before[:, 5 + out_dim :])
    base_rows = [t for t, slot in enumerate(slot_of_tokens) if slot < 0]
    assert torch.equal(out[base_rows], before[base_rows]), "a base token got a delta"


def check_lora_batch_kernel():
    """engine/lora/lora_batch.py with use_kernel=True (the CUDA path) against its torch
    layouts, on LoraSlots' own stacks (q, k, v side by side; ranks padded with zeros)."""
    from splitserve.engine.lora.lora_batch import KERNEL, LoraBatch
    from splitserve.engine.lora.lora_slots import PROJECTION_GROUPS, LoraSlots
    from splitserve.engine.model_config import ModelConfig

    config = ModelConfig("LlamaForCausalLM", 100, 32, 48, 2, 4, 2, 8, 64)
    slots = LoraSlots(config, max_loras=3, max_rank=8, dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(5)
    for targets in PROJECTION_GROUPS.values():
        for target in targets[:2]:  # the qkv group without v_proj: a target no adapter has
            a, b = slots._stacks(target)
            a.copy_(torch.randn(a.shape, generator=generator))
            b.copy_(torch.randn(b.shape, generator=generator))
    slots.scaling.copy_(torch.tensor([0.5, 2.0, 1.25]))
    slots.slot_scaling = slots.scaling.tolist()
    seq_slots, num_tokens = [2, None, 0, 2, 1], [3, 2, 1, 1, 4]
    kernel = LoraBatch(slots, seq_slots, num_tokens, use_kernel=True)
    torch_batch = LoraBatch(slots, seq_slots, num_tokens, use_kernel=False)
    assert kernel.layout == KERNEL and torch_batch.layout != KERNEL
    for group in PROJECTION_GROUPS:
        x = torch.randn(sum(num_tokens), slots.a_t[group].shape[2], generator=generator)
        before = torch.randn(sum(num_tokens), sum(w for _, _, w in slots.columns[group]), generator=generator)
        got, want = before.clone(), before.clone()
        kernel.add_delta(got, 1, group, x)
        torch_batch.add_delta(want, 1, group, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(got[3:5], before[3:5]), f"{group}: the base tokens got a delta"
        assert not torch.equal(got, before), f"{group}: no delta at all"


def check_engine_greedy_through_kernel():
    """LLMEngine on CPU with every LoraBatch on the kernels (as on CUDA): a batch of two peft
    adapters (ranks 8 and 4, different targets) and the base gives transformers + peft's greedy
    tokens for each, prefill and decode."""
    import tempfile
    from pathlib import Path

    import transformers

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.lora.lora_batch import KERNEL, LoraBatch
    from splitserve.proto.messages.sampling_params import SamplingParams
    from tests.helpers.peft_adapters import peft_greedy, write_peft_adapter
    from tests.helpers.transformers_checkpoint import SERVABLE_SHAPE, write_transformers_checkpoint

    build = LoraBatch.__init__
    layouts: set[str] = set()

    def on_kernels(self, slots, seq_slots, num_tokens, use_kernel=None):
        build(self, slots, seq_slots, num_tokens, use_kernel=True)
        layouts.add(self.layout)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_transformers_checkpoint(transformers.LlamaConfig(**SERVABLE_SHAPE), root / "base", seed=7, tokenizer=True)
        adapters = {
            "attn": write_peft_adapter(root / "base", root / "attn", 1, 8, 16, ["q_proj", "v_proj", "o_proj"], False),
            "mlp": write_peft_adapter(root / "base", root / "mlp", 2, 4, 8, ["gate_proj", "down_proj"], False),
        }
        modules = {name: str(path) for name, path in adapters.items()}
        config = EngineConfig(
            model=str(root / "base"), num_kv_blocks=32, enable_lora=True, lora_modules=modules, max_lora_rank=8
        )
        names = ["attn", None, "mlp"]
        prompts = [[5 + (7 * i + 3 * j) % 300 for j in range(6 + 3 * i)] for i in range(len(names))]
        params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, lora_adapter=n) for n in names]
        LoraBatch.__init__ = on_kernels  # type: ignore[method-assign]
        try:
            outputs = LLMEngine(config).generate(prompts, params)
        finally:
            LoraBatch.__init__ = build  # type: ignore[method-assign]
        assert layouts == {KERNEL}, layouts
        for name, prompt, out in zip(names, prompts, outputs):
            want = peft_greedy(root / "base", None if name is None else adapters[name], prompt, 4)
            assert out.token_ids == want, (name, out.token_ids, want)
