"""gpu_check check 11: the architectures' device paths.

sliding window  the Triton paged decode kernel with a window (a sliding-window layer reads
                only each sequence's last `window` tokens, from the block holding the first)
                vs the torch path, with every table entry wholly before a window pointing at
                a NaN block (a freed block may hold anything: one read of it shows); on a GPU
                also its time against the full-context kernel at a long context (info);
windowed parity transformers-written Mistral (every layer windowed) and Gemma 3 (sliding and
                global layers) checkpoints with small windows, through the real loader and
                LLMEngine on the device: fp32 logits of a prompt several windows long within
                1e-4 of transformers', and greedy tokens equal to transformers' generate.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from splitserve.bench.gpu_check.gpu_check_ops import HEAD_DIM, TOLERANCE, item, paged_problem, time_ms

FP32_TOLERANCE = 1e-4


def _window_cases(tiny: bool) -> list[tuple[int, int, int, torch.dtype]]:
    """(batch, longest context, window, dtype)."""
    if tiny:
        return [(3, 70, 24, torch.float32), (2, 40, 16, torch.float16)]
    return [(32, 8192, 1024, torch.bfloat16), (8, 32768, 4096, torch.float16), (64, 4096, 512, torch.float32)]


def _sliding_window_kernel(device: torch.device, tiny: bool) -> list[dict]:
    from splitserve.engine.ops import attention
    from splitserve.engine.ops import triton_decode_attention as kernels

    items = []
    for index, (batch, context, window, dtype) in enumerate(_window_cases(tiny)):
        lens = [context] + [max(1, context - 7 * i) for i in range(1, batch)]
        lens[-1] = max(1, window // 2)  # one context inside its window
        q, key_cache, value_cache, tables, lens_t = paged_problem(lens, dtype, device, seed=20 + index)
        nan_block = torch.full_like(key_cache[:1], float("nan"))
        freed = key_cache.shape[0]
        key_cache, value_cache = torch.cat((key_cache, nan_block)), torch.cat((value_cache, nan_block))
        reference = attention.paged_decode_attention_torch(
            q.float(), key_cache.float(), value_cache.float(), tables, lens_t, HEAD_DIM**-0.5, max(lens), window=window
        )
        for row, length in enumerate(lens):  # the blocks no query of this layer sees: "freed"
            tables[row, : max(length - window, 0) // 16] = freed
        scale = HEAD_DIM**-0.5
        out = kernels.paged_decode_attention(q, key_cache, value_cache, tables, lens_t, scale, window=window)
        error = (out.float() - reference).abs().max().item()
        limit = TOLERANCE[dtype] * (1 + reference.abs().max().item())
        ok = error <= limit and not out.isnan().any().item()
        name = f"window {window} decode b={batch} ctx<={context} {str(dtype)[6:]}"
        items.append(
            item(name, "pass" if ok else "fail", "freed blocks hold NaN", max_abs_error=error, tolerance=limit)
        )
        if device.type == "cuda":
            full_lens = torch.full_like(lens_t, context)
            full_tables = torch.randint(0, freed, (batch, -(-context // 16)), device=device, dtype=torch.int32)
            decode = functools.partial(
                kernels.paged_decode_attention, q, key_cache, value_cache, full_tables, full_lens, scale
            )
            windowed_ms = time_ms(functools.partial(decode, window=window), device)
            full_ms = time_ms(decode, device)
            items.append(
                item(
                    f"window {window} vs full context {context} b={batch} {str(dtype)[6:]}",
                    "info",
                    "same batch, every sequence at the full context",
                    windowed_ms=windowed_ms,
                    full_ms=full_ms,
                    speedup=full_ms / windowed_ms,
                )
            )
    return items


def _windowed_configs(tiny: bool) -> dict:
    import transformers

    shape = dict(
        vocab_size=512,  # the corpus tokenizer's (written beside the weights, for LLMEngine)
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    window = 24 if tiny else 64
    return {
        "mistral": transformers.MistralConfig(**shape, num_hidden_layers=2, sliding_window=window),
        "gemma3": transformers.Gemma3TextConfig(
            **shape,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=window,
            query_pre_attn_scalar=16,
        ),
    }


def _windowed_parity(device: torch.device, tiny: bool, work_dir: Path) -> list[dict]:
    import transformers

    from splitserve.bench.gpu_check.gpu_check_engine import _engine_logits
    from splitserve.engine.builtin_models.corpus_tokenizer import train_tokenizer, write_tokenizer
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.model.loader import load_model
    from splitserve.proto.messages.sampling_params import SamplingParams

    items = []
    for name, config in _windowed_configs(tiny).items():
        torch.manual_seed(5)
        hf = transformers.AutoModelForCausalLM.from_config(config).eval()
        path = work_dir / f"windowed-{name}"
        hf.save_pretrained(path)
        write_tokenizer(train_tokenizer(config.vocab_size), path, config.max_position_embeddings)
        hf = hf.to(device)
        window = config.sliding_window
        prompt = torch.randint(3, config.vocab_size, (4 * window + 5,), generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            expected_logits = hf(prompt[None].to(device)).logits[0].float()
        model, _ = load_model(path, dtype="float32", device=device)
        error = (_engine_logits(model, prompt.tolist(), device, num_decode=window) - expected_logits).abs().max()
        items.append(
            item(
                f"{name} window {window} fp32 logits, prompt {len(prompt)}",
                "pass" if error.item() <= FP32_TOLERANCE else "fail",
                f"last {window} positions by decode steps; tolerance {FP32_TOLERANCE}",
                max_abs_error=error.item(),
            )
        )
        del model
        engine = LLMEngine(
            EngineConfig(model=str(path), device=str(device), num_kv_blocks=64, max_num_batched_tokens=2 * window)
        )
        num_new = 2 * window
        with torch.no_grad():
            generated = hf.generate(
                prompt[None].to(device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                max_new_tokens=num_new,
                min_new_tokens=num_new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=config.pad_token_id,
            )
        expected = generated[0, len(prompt) :].tolist()
        out = engine.generate([prompt.tolist()], SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True))
        mine = list(out[0].token_ids)
        items.append(
            item(
                f"{name} window {window} greedy, chunked prefill",
                "pass" if mine == expected else "fail",
                f"chunks of {2 * window} tokens, {num_new} decode steps",
                matching=sum(a == b for a, b in zip(mine, expected)),
                tokens=num_new,
            )
        )
        del engine, hf
    return items


def check_architectures(device: torch.device, tiny: bool, work_dir: Path) -> dict:
    return {"items": _sliding_window_kernel(device, tiny) + _windowed_parity(device, tiny, work_dir)}
