"""fp8/int8 KV cache on the trained small model: quality, capacity, handoff bytes, decode speed.

  python -m splitserve.bench.quantization.kv_cache_quantization          # writes bench/results/kv_cache_quantization.md

Quality: per-(token, head) vs per-(block, head) scales on real activations
(bench/quantization/kv_quant_granularity.py); perplexity on held-out text (written for this benchmark, not
in the training corpus) from the engine's prompt log-probabilities; greedy agreement with the
full-precision cache. Capacity: KV blocks per GiB. Handoff: bytes a 2048-token prefill ->
decode transfer moves over a real gloo pair (TransferStats counters). Speed: decode tokens/s
of the colocated engine at batch 1 and 32, auto vs fp8, interleaved, one torch thread.
"""

from __future__ import annotations

import argparse
import math
import os
import threading
import time
from pathlib import Path

import torch

from splitserve.bench import RESULTS_DIR, source_commit
from splitserve.bench.quantization.kv_cache_quantization_report import HELD_OUT, write_report
from splitserve.bench.quantization.kv_quant_granularity import attention_errors, captured_attention_inputs
from splitserve.engine.builtin_models.corpus import PASSAGES
from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_sizing import kv_bytes_per_block
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig
from splitserve.proto.messages.sampling_params import SamplingParams

DEFAULT_OUT = RESULTS_DIR / "kv_cache_quantization.md"
KV_DTYPES = ("auto", "fp8", "int8")
BLOCK_SIZE = 16


def engine(model_dir: str, kv_cache_dtype: str, num_kv_blocks: int = 1024, **kw) -> LLMEngine:
    config = EngineConfig(model=model_dir, num_kv_blocks=num_kv_blocks, kv_cache_dtype=kv_cache_dtype, **kw)
    return LLMEngine(config)


def granularity(model_dir: str) -> dict:
    records: list = []
    auto = engine(model_dir, "auto")
    with captured_attention_inputs(auto, records):
        auto.generate(HELD_OUT, SamplingParams(max_tokens=1, temperature=0))
    return attention_errors(records, auto.model_config.head_dim, BLOCK_SIZE)


def quality(model_dir: str, max_new_tokens: int) -> dict:
    """Per KV dtype: held-out perplexity, and greedy outputs on corpus and held-out prompts."""
    engines = {dtype: engine(model_dir, dtype) for dtype in KV_DTYPES}
    tokenizer = engines["auto"].tokenizer
    prompts = [tokenizer.encode(p)[:24] for p in PASSAGES[:-1]] + [tokenizer.encode(t)[:24] for t in HELD_OUT]
    greedy = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
    scoring = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    results = {}
    corpus = list(PASSAGES[:-1])  # in-distribution text, where the model is good

    def perplexity(eng, texts) -> tuple[float, int]:
        logprobs = [lp for out in eng.generate(texts, scoring) for lp in out.prompt_logprobs]
        return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs)

    for dtype, eng in engines.items():
        (ppl, tokens), (corpus_ppl, corpus_tokens) = perplexity(eng, HELD_OUT), perplexity(eng, corpus)
        outputs = [out.token_ids for out in eng.generate(prompts, greedy)]
        results[dtype] = {"ppl": ppl, "tokens": tokens, "corpus_ppl": corpus_ppl, "corpus_tokens": corpus_tokens}
        results[dtype]["out"] = outputs
    ref = results["auto"]["out"]
    for res in results.values():
        pairs = [(a, b) for ra, rb in zip(ref, res["out"]) for a, b in zip(ra, rb)]
        res["agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        res["identical"] = sum(ra == rb for ra, rb in zip(ref, res["out"]))
        res["num_prompts"] = len(ref)
        res["dppl"] = res["ppl"] / results["auto"]["ppl"] - 1
        res["corpus_dppl"] = res["corpus_ppl"] / results["auto"]["corpus_ppl"] - 1
    return results


def capacity(model_dir: str) -> dict:
    model = ModelConfig.from_pretrained(model_dir)
    cases = {"auto (bfloat16)": ("auto", "bfloat16"), "auto (float32)": ("auto", "float32")}
    cases.update({"fp8": ("fp8", None), "int8": ("int8", None)})
    out = {}
    for name, (kv, dtype) in cases.items():
        per_block = kv_bytes_per_block(model, BLOCK_SIZE, kv, dtype)
        out[name] = {"bytes_per_block": per_block, "blocks_per_gib": 2**30 // per_block}
    return out


def handoff_bytes(model_dir: str, num_tokens: int) -> dict:
    """Bytes one num_tokens handoff moves over a real gloo pair, per KV dtype (layer-wise)."""
    from splitserve.engine.ops.kv_cache import KVCache
    from splitserve.kvtransfer import KVTransport
    from splitserve.kvtransfer.kv_receiver import PostedReceive
    from splitserve.kvtransfer.kv_sender import KVSender, SendJob

    model = ModelConfig.from_pretrained(model_dir)
    num_blocks = num_tokens // BLOCK_SIZE
    prefill = KVTransport("bench-prefill", "cpu", timeout_s=60)
    decode = KVTransport("bench-decode", "cpu", timeout_s=60)
    opened = threading.Thread(target=prefill.open_pair, args=("bench-decode", None, "sender", 0))
    opened.start()
    decode.open_pair("bench-prefill", prefill.address, "receiver", 0)
    opened.join(60)
    out = {}
    try:
        cases = (("auto (bfloat16)", "auto", "bfloat16"), ("auto (float32)", "auto", "float32"))
        cases += (("fp8", "fp8", "bfloat16"), ("int8", "int8", "bfloat16"))
        for transfer_id, (name, kv, dtype) in enumerate(cases, 1):
            config = EngineConfig(model=model_dir, num_kv_blocks=num_blocks, kv_cache_dtype=kv, dtype=dtype)
            source, target = KVCache(model, config), KVCache(model, config)
            before = prefill.stats().bytes_sent
            sender = KVSender(prefill, source)
            ids = list(range(num_blocks))
            posted = PostedReceive(decode, target, "bench-prefill", transfer_id, ids, layerwise=True)
            sender.send_all(SendJob(f"r{transfer_id}", "bench-decode", transfer_id, ids, layerwise=True))
            posted.complete(60)
            sender.close()
            out[name] = prefill.stats().bytes_sent - before
    finally:
        decode.close()
        prefill.close()
    return out


def decode_speed(model_dir: str, batches: list[int], max_tokens: int, reps: int) -> dict:
    """(kv dtype, batch) -> best tokens/s over reps, auto and fp8 runs interleaved."""
    engines = {dtype: engine(model_dir, dtype, num_kv_blocks=max(batches) * 8 + 16) for dtype in ("auto", "fp8")}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    best: dict[tuple[str, int], float] = {}
    for batch in batches:
        prompts = [[10 + (i * 7 + j) % 500 for j in range(16)] for i in range(batch)]
        for _ in range(reps):
            for dtype, eng in engines.items():
                start = time.perf_counter()
                eng.generate(prompts, params)
                rate = batch * max_tokens / (time.perf_counter() - start)
                best[dtype, batch] = max(best.get((dtype, batch), 0.0), rate)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--handoff-tokens", type=int, default=2048)
    parser.add_argument("--speed-tokens", type=int, default=32)
    parser.add_argument("--speed-reps", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    commit = source_commit()
    load_before = os.getloadavg()
    model_dir = str(cached_checkpoint(ModelSpec("small", "llama", seed=0, train_steps=300)).path)
    results = {
        "model_dir": model_dir,
        "granularity": granularity(model_dir),
        "quality": quality(model_dir, args.max_new_tokens),
        "capacity": capacity(model_dir),
        "handoff": handoff_bytes(model_dir, args.handoff_tokens),
        "speed": decode_speed(model_dir, [1, 32], args.speed_tokens, args.speed_reps),
    }
    results["load"] = (load_before, os.getloadavg())
    write_report(args, results, commit)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
