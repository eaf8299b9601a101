"""gpu_check check 4: LLMEngine decode throughput on a ~1B-parameter random Llama in bf16.

The engine has no CUDA graphs, so each decode step is split into GPU busy time (the union of
kernel and copy intervals in a torch.profiler trace) and host overhead (the step's wall time
minus that): a large host share at small batches is what CUDA graphs would remove.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from splitserve.bench.gpu_check.gpu_check_ops import item

# Llama-3.2-1B-like with a 32k vocabulary: ~1.1B parameters.
ONE_B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=32000,
)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
)
_DEVICE_EVENT_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")


def write_llama(out_dir: Path, shape: dict, device: torch.device, seed: int = 0) -> tuple[Path, int]:
    """A random bf16 Llama checkpoint of this shape, with the test tokenizer (its vocabulary is
    smaller; ids past it decode to nothing). Weights are drawn on the device: a 1B model takes
    seconds. Returns (directory, parameter count)."""
    from safetensors.torch import save_file

    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    donor = write_random_checkpoint(out_dir.parent / "tokenizer-donor", preset="tiny")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(donor / name, out_dir / name)
    config = json.loads((donor / "config.json").read_text())
    config.update(shape, max_position_embeddings=4096, torch_dtype="bfloat16", tie_word_embeddings=False)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q_dim = shape["num_attention_heads"] * shape["head_dim"]
    kv_dim = shape["num_key_value_heads"] * shape["head_dim"]

    def linear(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
        weight = torch.randn(rows, cols, generator=gen, device=device) * (gain / cols**0.5)
        return weight.to(torch.bfloat16).cpu()

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    weights = {
        "model.embed_tokens.weight": linear(shape["vocab_size"], hidden, gain=0.1 * hidden**0.5),
        "model.norm.weight": ones.clone(),
        "lm_head.weight": linear(shape["vocab_size"], hidden),
    }
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = ones.clone()
        weights[p + "post_attention_layernorm.weight"] = ones.clone()
        weights[p + "self_attn.q_proj.weight"] = linear(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = linear(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = linear(hidden, q_dim)
        weights[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = linear(hidden, inter)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir, sum(t.numel() for t in weights.values())


def _busy_ms(trace_path: Path) -> float:
    """Time covered by at least one kernel, copy or memset in a Chrome trace."""
    events = json.loads(trace_path.read_text()).get("traceEvents", [])
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if str(e.get("cat", "")).lower() in _DEVICE_EVENT_KINDS and "ts" in e
    )
    busy_us, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy_us += stop - max(start, end)
            end = stop
    return busy_us / 1e3


def _host_top(prof, num_steps: int, count: int = 6) -> str:
    """The torch ops with the most host (self CPU) time per step, after all ops' total: where the
    host share goes (what the ops do not cover is Python between them)."""
    averages = list(prof.key_averages())
    total_ms = sum(e.self_cpu_time_total for e in averages) / 1e3 / num_steps
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:count]
    return f"all ops {total_ms:.2f} ms; " + ", ".join(
        f"{e.key} {e.self_cpu_time_total / 1e3 / num_steps:.2f} ms x{e.count // num_steps}" for e in top
    )


def _run_batch(
    engine, batch: int, prompt_len: int, steps: dict, max_tokens: int, device: torch.device, trace: Path
) -> dict:
    from splitserve.proto.messages.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(prompt_token_ids=torch.randint(5, 500, (prompt_len,), generator=gen).tolist(), params=params)
    started, decoding = set(), True
    while len(started) < batch:  # prefill (chunked) until every request has its first token
        started.update(out.request_id for out in engine.step())
    for _ in range(steps["warmup"]):
        engine.step()
    walls = []
    for _ in range(steps["timed"]):
        begin = time.perf_counter()
        decoding &= len(engine.step()) == batch
        walls.append((time.perf_counter() - begin) * 1e3)
    wall_ms = statistics.median(walls)
    result = {"ms_per_step": wall_ms, "tokens_per_s": batch / (wall_ms / 1e3)}
    profiled = 0  # steps run under the profiler
    if device.type == "cuda":
        try:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps["profiled"]):
                    decoding &= len(engine.step()) == batch
                    profiled += 1
            prof.export_chrome_trace(str(trace))
            gpu_ms = _busy_ms(trace) / steps["profiled"]
            result.update(gpu_ms_per_step=gpu_ms, host_ms_per_step=max(wall_ms - gpu_ms, 0.0))
            result["host_share"] = result["host_ms_per_step"] / wall_ms
            result["host_top"] = _host_top(prof, steps["profiled"])
        except Exception as exc:  # keep the wall-clock numbers; say why the split is missing
            result["profiler_error"] = f"{type(exc).__name__}: {exc}"
    for _ in range(steps["profiled"] - profiled):
        decoding &= len(engine.step()) == batch
    while engine.has_unfinished():
        engine.step()
    result["full_batch_every_step"] = decoding
    return result


def check_throughput(device: torch.device, tiny: bool, work_dir: Path) -> dict:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    path, num_params = write_llama(work_dir / "llama-1b", TINY if tiny else ONE_B, device)
    batches = (1, 4, 8) if tiny else (1, 32, 256)
    prompt_len = 32 if tiny else 512
    steps = {"warmup": 2, "timed": 4, "profiled": 2} if tiny else {"warmup": 8, "timed": 32, "profiled": 8}
    max_batched = 512 if tiny else 8192
    # The first requests decode while the last still prefill (chunked, max_batched tokens a
    # step, one step more under async scheduling): they need that many more tokens, or they
    # finish inside the measured steps and the batch shrinks.
    max_tokens = sum(steps.values()) + 2 + -(-max(batches) * prompt_len // max_batched) + 2
    blocks_per_seq = -(-(prompt_len + max_tokens) // 16)
    config = EngineConfig(
        model=str(path),
        dtype="bfloat16",
        device=str(device),
        num_kv_blocks=max(batches) * blocks_per_seq + 16,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max_batched,
        enable_prefix_caching=False,
    )
    engine = LLMEngine(config)
    items = [
        item("model", "info", "random Llama, bf16, no CUDA graphs", parameters=num_params, prompt_tokens=prompt_len)
    ]
    with torch.inference_mode():
        for batch in batches:
            result = _run_batch(engine, batch, prompt_len, steps, max_tokens, device, work_dir / f"trace-{batch}.json")
            full = result.pop("full_batch_every_step")
            notes = [] if full else ["a decode step returned fewer outputs than the batch"]
            if "host_share" in result:
                notes.insert(0, f"host overhead {result['host_share']:.0%} of a step")
            if "host_top" in result:
                notes.append(f"host time per step by op: {result.pop('host_top')}")
            if "profiler_error" in result:
                notes.append(f"no GPU/host split: the profiler failed ({result.pop('profiler_error')})")
            note = "; ".join(notes)
            items.append(item(f"decode batch {batch}", "info" if full else "fail", note, **result))
    return {"items": items}
