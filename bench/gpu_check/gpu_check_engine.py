"""gpu_check check 1: engine parity with transformers on the device.

It runs the llama, mistral and qwen2 test configs (random weights, written as HF checkpoints,
loaded by splitserve's loader and by transformers on the same device):
  fp32       prefill logits and teacher-forced decode logits (the paged decode kernel) within 1e-4;
  bf16/fp16  (a) the engine's logits are no further from the fp32 reference than transformers'
                 in that dtype: median per-position max error <= 1.5x transformers' + 0.02;
             (b) LLMEngine's greedy tokens equal transformers' greedy tokens in that dtype, or the
                 first difference is a near-tie: the fp32 logit gap between the two tokens is at
                 most the sum of both sides' measured max logit errors, on the prompt or at the differing
                 position, whichever is larger (what rounding can flip);
             (c) bf16 only: seeded sampling (temperature, top-p) runs on the device and repeats.
The two greedy prompts (of different lengths) run as one batch, so decode is ragged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from splitserve.bench.gpu_check.gpu_check_ops import item

ARCHS = {"llama": 1, "mistral": 2, "qwen2": 3}  # the test suite's configs and seeds
FP32_TOLERANCE = 1e-4
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _prompts(tokenizer, tiny: bool) -> list[list[int]]:
    from splitserve.engine.builtin_models.corpus import TEXT

    ids = tokenizer.encode(TEXT[:4000])
    lengths = (24, 40) if tiny else (96, 160)
    return [ids[: lengths[0]], ids[500 : 500 + lengths[1]]]


def _engine_logits(model, ids: list[int], device: torch.device, num_decode: int = 0) -> torch.Tensor:
    """Logits of every position of ids: the first len(ids) - num_decode by one prefill, the rest
    one decode step each through the paged cache."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.ops.attention_metadata import AttentionMetadata
    from splitserve.engine.ops.kv_cache import KVCache

    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[model.dtype]
    num_blocks = -(-len(ids) // 16) + 1
    cache = KVCache(model.config, EngineConfig(model="-", num_kv_blocks=num_blocks, dtype=name, device=str(device)))
    table = list(range(1, num_blocks))  # block 0 stays unused: a wrong table entry reads zeros
    rows, start = [], 0
    for end in [len(ids) - num_decode] + list(range(len(ids) - num_decode + 1, len(ids) + 1)):
        positions = list(range(start, end))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // 16] * 16 + p % 16 for p in positions], device=device),
            query_start_loc=torch.tensor([0, len(positions)], dtype=torch.int32, device=device),
            context_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables=torch.tensor([table], dtype=torch.int32, device=device),
            query_start_loc_cpu=[0, len(positions)],
            context_lens_cpu=[end],
            max_query_len=len(positions),
            max_context_len=end,
        )
        hidden = model(torch.tensor(ids[start:end], device=device), torch.tensor(positions, device=device), cache, meta)
        rows.append(model.compute_logits(hidden))
        start = end
    return torch.cat(rows)


def _hf_logits(hf, ids: list[int], device: torch.device) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids], device=device)).logits[0].float()


def _hf_greedy(hf, prompt: list[int], num_new: int, device: torch.device, pad_id: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    return out[0, len(prompt) :].tolist()


def _parity_one(path: Path, arch: str, device: torch.device, tiny: bool) -> list[dict]:
    import transformers

    from splitserve.engine.config import EngineConfig
    from splitserve.engine.io.tokenizer import Tokenizer
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model.loader import load_model
    from splitserve.proto.messages.sampling_params import SamplingParams

    tokenizer = Tokenizer.from_pretrained(path)
    prompts = _prompts(tokenizer, tiny)
    num_new = 8 if tiny else 32
    hf32 = transformers.AutoModelForCausalLM.from_pretrained(path).to(device).eval()
    continuation = _hf_greedy(hf32, prompts[0], 4 if tiny else 8, device, tokenizer.pad_token_id)
    sequence = prompts[0] + continuation
    reference = _hf_logits(hf32, sequence, device)
    model, _ = load_model(path, dtype="float32", device=device)
    ours = _engine_logits(model, sequence, device, num_decode=len(continuation))
    prefill_error = (ours[: len(prompts[0])] - reference[: len(prompts[0])]).abs().max().item()
    decode_error = (ours[len(prompts[0]) :] - reference[len(prompts[0]) :]).abs().max().item()
    worst = max(prefill_error, decode_error)
    items = [
        item(
            f"{arch} fp32 logits",
            "pass" if worst <= FP32_TOLERANCE else "fail",
            f"tolerance {FP32_TOLERANCE}",
            prefill_max_abs=prefill_error,
            decode_max_abs=decode_error,
        )
    ]
    del model
    for name, dtype in DTYPES.items():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).to(device=device, dtype=dtype).eval()
        model, _ = load_model(path, dtype=name, device=device)
        prompt_ref = reference[: len(prompts[0])]
        ours_err = (_engine_logits(model, prompts[0], device) - prompt_ref).abs().max(dim=-1).values
        hf_err = (_hf_logits(hf, prompts[0], device) - prompt_ref).abs().max(dim=-1).values
        ours_median, hf_median = ours_err.median().item(), hf_err.median().item()
        close = ours_median <= 1.5 * hf_median + 0.02
        items.append(
            item(
                f"{arch} {name} logits vs fp32",
                "pass" if close else "fail",
                "engine median error <= 1.5x transformers' + 0.02",
                engine_median=ours_median,
                hf_median=hf_median,
                engine_max=ours_err.max().item(),
                hf_max=hf_err.max().item(),
            )
        )
        tie_tolerance = ours_err.max().item() + hf_err.max().item()
        engine = LLMEngine(
            EngineConfig(
                model=str(path),
                dtype=name,
                device=str(device),
                num_kv_blocks=64,
                max_num_seqs=4,
                max_num_batched_tokens=512,
            )
        )
        params = SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True)
        outputs = engine.generate(prompts, params)
        for index, (prompt, out) in enumerate(zip(prompts, outputs)):
            expected = _hf_greedy(hf, prompt, num_new, device, tokenizer.pad_token_id)
            mine = list(out.token_ids)
            split = next((i for i, (a, b) in enumerate(zip(mine, expected)) if a != b), None)
            numbers = {"tokens": len(mine), "matching_prefix": len(mine) if split is None else split}
            status, note = ("pass" if mine == expected else "fail"), "identical"
            if split is not None:
                prefix = prompt + expected[:split]
                gap_logits = _hf_logits(hf32, prefix, device)[-1]
                gap = (gap_logits[expected[split]] - gap_logits[mine[split]]).abs().item()
                # Rounding error grows along a generation: also measure both sides' error at
                # the very position that differs, beside the prompt's.
                ours_here = (_engine_logits(model, prefix, device)[-1] - gap_logits).abs().max().item()
                hf_here = (_hf_logits(hf, prefix, device)[-1] - gap_logits).abs().max().item()
                tolerance = max(tie_tolerance, ours_here + hf_here)
                numbers.update(fp32_gap=gap, tie_tolerance=tolerance, prompt_tie_tolerance=tie_tolerance)
                status = "pass" if gap <= tolerance else "fail"
                note = f"first difference at token {split}: a near-tie" if status == "pass" else "not a near-tie"
            items.append(item(f"{arch} {name} greedy prompt {index}", status, note, **numbers))
        if name == "bfloat16":
            items.append(_seeded_sampling(engine, arch, prompts[0], num_new))
            if arch == "llama":
                items.append(_speculative(path, device, prompts[0], list(outputs[0].token_ids)))
        del engine, hf, model
    return items


def _seeded_sampling(engine, arch: str, prompt: list[int], num_new: int) -> dict:
    """Sampling (temperature, top-p) with a per-request seed runs on the device and repeats."""
    from splitserve.proto.messages.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=num_new, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    try:
        first, second = (engine.generate([prompt], params)[0].token_ids for _ in range(2))
    except Exception as exc:  # reported as this item's failure; the other items still run
        return item(f"{arch} bfloat16 seeded sampling", "fail", f"{type(exc).__name__}: {exc}")
    ok = list(first) == list(second) and len(first) == num_new
    return item(
        f"{arch} bfloat16 seeded sampling", "pass" if ok else "fail", "same seed, same tokens", tokens=len(first)
    )


def _speculative(path: Path, device: torch.device, prompt: list[int], greedy: list[int]) -> dict:
    """Speculative decoding on the device, the checkpoint as its own draft (k = 4, fixed): greedy
    gives the plain engine's tokens, and unseeded sampling runs through the rejection sampler
    (a device row against the draft's host distribution, the host generator drawing)."""
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.proto.messages.sampling_params import SamplingParams

    draft = {"method": "draft", "draft_model": str(path), "num_speculative_tokens": 4, "policy": "fixed"}
    name = "llama bfloat16 speculative decoding"
    try:
        engine = LLMEngine(
            EngineConfig(model=str(path), dtype="bfloat16", device=str(device), num_kv_blocks=64, speculative=draft)
        )
        (mine,) = engine.generate([prompt], SamplingParams(max_tokens=len(greedy), temperature=0.0, ignore_eos=True))
        sampled = SamplingParams(max_tokens=len(greedy), temperature=0.8, top_p=0.9, ignore_eos=True)
        (drawn,) = engine.generate([prompt], sampled)
    except Exception as exc:  # reported as this item's failure; the other items still run
        return item(name, "fail", f"{type(exc).__name__}: {exc}")
    ok = list(mine.token_ids) == greedy and len(drawn.token_ids) == len(greedy)
    return item(
        name,
        "pass" if ok else "fail",
        "greedy equals the plain engine's; sampling ran",
        tokens=len(mine.token_ids),
        sampled_tokens=len(drawn.token_ids),
    )


def check_parity(device: torch.device, tiny: bool, work_dir: Path) -> dict:
    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    items = []
    for arch, seed in ARCHS.items():
        path = write_random_checkpoint(work_dir / f"parity-{arch}", preset="tiny", arch=arch, seed=seed)
        items += _parity_one(path, arch, device, tiny)
    return {"items": items}
