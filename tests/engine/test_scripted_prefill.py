"""A fresh prompt's prefill as one TorchScript call (engine/model/prefill_graph.py): bitwise the
eager forward's hidden state and KV writes for every architecture it covers, the steps it
leaves to the eager forward, the switch, whole engines' tokens, and that it runs without the
GIL."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import CPU_PREFILL_FORWARD_ENV
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model.loader import load_model
from splitserve.engine.model.scripted_decode import CPU_DECODE_FORWARD_ENV
from splitserve.engine.ops.onednn_packed_weight import CPU_MATMUL_ENV
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.engine.test_scripted_decode import _conclusive, _decode_batch
from tests.helpers.model import contiguous_metadata, make_checkpoint


def _prompt(model, config, length: int, seed: int = 0):
    """A cache holding other sequences' K/V and one fresh prompt of length tokens in blocks of
    its own: (ids, positions, cache, meta)."""
    _, _, cache, _ = _decode_batch(model, config, [2, 2], seed)  # random K/V everywhere
    meta = contiguous_metadata([length], [length], block_size=4, blocks_per_seq=16, block_ranges=[1])
    ids = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(length), cache, meta


def _both(model, ids, positions, cache, meta, rows):
    start = cache.kv.clone()
    scripted = model._scripted_decode
    scripted.prefills = False
    eager = model(ids, positions, cache, meta, output_rows=rows), cache.kv.clone()
    cache.kv.copy_(start)
    scripted.prefills = True
    return eager, (model(ids, positions, cache, meta, output_rows=rows), cache.kv.clone())


@pytest.mark.parametrize("matmul", ["onednn", "blas"])
# qwen2: a qkv bias and tied embeddings; qwen3: q/k norms; phi3: weights loaded from fused
# tensors; mixtral / qwen3_moe: the experts (qwen3_moe with a dense layer)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "mixtral", "qwen3_moe"])
def test_scripted_prefill_is_bitwise_the_eager_forward(models_root, monkeypatch, matmul, arch):
    monkeypatch.setenv(CPU_MATMUL_ENV, matmul)
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)
    monkeypatch.setenv(CPU_PREFILL_FORWARD_ENV, "scripted")
    model, config = load_model(make_checkpoint(models_root, "tiny", arch))
    scripted = model._scripted_decode
    assert scripted is not None and scripted.prefills
    for seed, length in enumerate([2, 5, 17, 40]):
        ids, positions, cache, meta = _prompt(model, config, length, seed)
        for rows in ([length - 1], []):  # the prompt's last row read out; a chunk reading none
            assert scripted.prefill_applies(meta, cache, rows)
            (eager_hidden, eager_cache), (hidden, after) = _both(model, ids, positions, cache, meta, rows)
            assert hidden.shape == (len(rows), config.hidden_size)
            assert torch.equal(hidden, eager_hidden), (length, rows)
            assert torch.equal(after, eager_cache)  # every layer's K/V, in the same slots


def test_steps_the_scripted_prefill_does_not_take(models_root, monkeypatch):
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)
    monkeypatch.setenv(CPU_PREFILL_FORWARD_ENV, "scripted")
    model, config = load_model(make_checkpoint(models_root, "tiny", "llama"))
    scripted = model._scripted_decode
    ids, positions, cache, meta = _prompt(model, config, 9)
    assert scripted.prefill_applies(meta, cache, [8])
    assert not scripted.prefill_applies(meta, cache, [3, 8])  # rows but the last read out
    assert not scripted.prefill_applies(meta, cache, [3])
    cached_prefix = contiguous_metadata([9], [4], block_size=4, blocks_per_seq=16)
    assert not scripted.prefill_applies(cached_prefix, cache, [3])
    two_prompts = contiguous_metadata([9, 5], [9, 5], block_size=4, blocks_per_seq=16)
    assert not scripted.prefill_applies(two_prompts, cache, [8, 13])
    one_token = contiguous_metadata([1], [1], block_size=4, blocks_per_seq=16)
    assert not scripted.prefill_applies(one_token, cache, [0])
    _, _, fp8_cache, _ = _decode_batch(model, config, [6, 9], kv_dtype="fp8")
    assert not scripted.prefill_applies(meta, fp8_cache, [8])
    # Sliding-window layers (Gemma 3) and the switch set to eager keep the eager prefill.
    assert not load_model(make_checkpoint(models_root, "tiny", "gemma3"))[0]._scripted_decode.prefills
    monkeypatch.delenv(CPU_PREFILL_FORWARD_ENV)  # on by default
    assert load_model(make_checkpoint(models_root, "tiny", "llama"))[0]._scripted_decode.prefills
    monkeypatch.setenv(CPU_PREFILL_FORWARD_ENV, "eager")
    reloaded = load_model(make_checkpoint(models_root, "tiny", "llama"))[0]._scripted_decode
    assert reloaded is not None and not reloaded.prefills
    monkeypatch.setenv(CPU_PREFILL_FORWARD_ENV, "jit")
    with pytest.raises(ValueError, match=f"{CPU_PREFILL_FORWARD_ENV} must be one of scripted, eager"):
        load_model(make_checkpoint(models_root, "tiny", "llama"))


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_scripted_and_eager_prefill_engines_generate_the_same(models_root, monkeypatch, arch):
    """Whole engines: prompts prefilled in one step and in chunks (the first chunk reads out no
    row; later ones have a cached prefix and run eagerly), a prefix-cache hit, greedy and
    seeded sampling with log-probabilities: the eager prefill's tokens and log-probabilities."""
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)
    path = str(make_checkpoint(models_root, "tiny", arch))
    shared = list(range(3, 40))
    prompts = [[5, 9, 14, 3, 22, 7], [11, 4, 30, 2], shared, shared + [8] * 9, [8] * 50]
    kinds = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=True),
    }
    runs = {}
    for forward in ("scripted", "eager"):
        monkeypatch.setenv(CPU_PREFILL_FORWARD_ENV, forward)
        engine = LLMEngine.from_model_dir(path, num_kv_blocks=64, max_num_batched_tokens=32)
        assert engine.model._scripted_decode.prefills == (forward == "scripted")
        for kind, params in kinds.items():
            # One request at a time, so that each prompt's first step is a fresh prompt alone.
            runs[forward, kind] = [
                (o.token_ids, o.logprobs) for prompt in prompts for o in engine.generate([prompt], params)
            ]
    for kind in kinds:
        assert runs["scripted", kind] == runs["eager", kind], kind


def test_the_scripted_prefill_runs_without_the_gil(models_root, monkeypatch):
    """Every layer's K/V of a prompt is written while another thread holds the GIL."""
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)
    monkeypatch.setenv(CPU_PREFILL_FORWARD_ENV, "scripted")
    model, config = load_model(make_checkpoint(models_root, "small", "llama"))
    ids, positions, cache, meta = _prompt(model, config, 24)
    slot = int(meta.slot_mapping[-1])
    prefill = lambda: model(ids, positions, cache, meta, output_rows=[23])  # noqa: E731
    prefill()  # TorchScript profiles its first runs
    prefill()
    assert _conclusive(prefill, cache, config, slot, seconds=60) is True
