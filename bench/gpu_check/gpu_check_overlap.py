"""gpu_check check 9: async scheduling's overlap -- LLMEngine decode step time with async
scheduling (engine/step_pipeline.py) and without (the synchronous step), at batch 1, 8, 64 and
256 on check 4's ~1B random Llama in bf16 (tiny sizes and batch 1 and 8 on the CPU dry run).

Per batch: the median wall milliseconds of a decode step in each mode, the speed-up, and from
the engine's step timing (engine/step_timing.py) the forward and host milliseconds per step and
the share of host work hidden behind the forward (overlap = 1 - exposed / host). The two modes
also decode the same greedy tokens (a check that fails if they do not).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from splitserve.bench.gpu_check.gpu_check_ops import item
from splitserve.bench.gpu_check.gpu_check_throughput import ONE_B, TINY, write_llama

MODES = {"overlap": True, "sync": False}


def _timing(engine) -> tuple[int, float, float, float]:
    stats = engine.stats()
    return stats.num_timed_steps, stats.step_forward_seconds, stats.step_host_seconds, stats.step_exposed_host_seconds


def _decode(engine, batch: int, prompt_len: int, steps: dict, seed: int) -> dict:
    """Decode steps of one full batch: ms per step, step timing, and the greedy tokens."""
    from splitserve.proto.messages.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps["warmup"] + steps["timed"] + 4, temperature=0.0, ignore_eos=True)
    ids = [
        engine.add_request(prompt_token_ids=torch.randint(5, 500, (prompt_len,), generator=gen).tolist(), params=params)
        for _ in range(batch)
    ]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> int:
        outputs = engine.step()
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        return len(outputs)

    while sum(1 for t in tokens.values() if t) < batch:  # prefill until every request streams
        step()
    for _ in range(steps["warmup"]):
        step()
    before = _timing(engine)
    walls = []
    for _ in range(steps["timed"]):
        begin = time.perf_counter()
        step()
        walls.append((time.perf_counter() - begin) * 1e3)
    after = _timing(engine)
    while engine.has_unfinished():
        step()
    num, forward, host, exposed = (a - b for a, b in zip(after, before))
    return {
        "ms_per_step": statistics.median(walls),
        "forward_ms": forward / max(num, 1) * 1e3,
        "host_ms": host / max(num, 1) * 1e3,
        "exposed_host_ms": exposed / max(num, 1) * 1e3,
        "overlap": max(0.0, 1 - exposed / host) if host > 0 else 0.0,
        "tokens": [tokens[rid] for rid in ids],
    }


def check_overlap(device: torch.device, tiny: bool, work_dir: Path) -> dict:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    path, _ = write_llama(work_dir / "llama-1b", TINY if tiny else ONE_B, device)
    batches = (1, 8) if tiny else (1, 8, 64, 256)
    prompt_len = 32 if tiny else 256
    steps = {"warmup": 2, "timed": 6} if tiny else {"warmup": 8, "timed": 32}
    blocks_per_seq = -(-(prompt_len + steps["warmup"] + steps["timed"] + 8) // 16)
    engines = {
        mode: LLMEngine(
            EngineConfig(
                model=str(path),
                dtype="bfloat16",
                device=str(device),
                num_kv_blocks=max(batches) * blocks_per_seq + 16,
                max_num_seqs=max(batches),
                max_num_batched_tokens=512 if tiny else 8192,
                enable_prefix_caching=False,
                async_scheduling=on,
            )
        )
        for mode, on in MODES.items()
    }
    items = [
        item(
            "model", "info", "check 4's random Llama, bf16; the next step scheduled ahead, forwards on a forward thread"
        )
    ]
    with torch.inference_mode():
        for batch in batches:
            results = {mode: _decode(engine, batch, prompt_len, steps, seed=batch) for mode, engine in engines.items()}
            same = results["overlap"].pop("tokens") == results["sync"].pop("tokens")
            on, off = results["overlap"], results["sync"]
            numbers = {f"{mode}_{key}": value for mode, result in results.items() for key, value in result.items()}
            numbers["speedup"] = off["ms_per_step"] / on["ms_per_step"]
            note = (
                f"{off['ms_per_step']:.2f} -> {on['ms_per_step']:.2f} ms/step ({numbers['speedup']:.2f}x); "
                f"host {on['host_ms']:.2f} ms/step, {on['overlap']:.0%} of it overlapped"
            )
            if not same:
                note += "; greedy tokens differ between the modes"
            items.append(item(f"decode batch {batch}", "info" if same else "fail", note, **numbers))
    return {"items": items}
