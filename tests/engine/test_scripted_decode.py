"""The CPU decode forward as one TorchScript call (engine/model/scripted_decode.py): bitwise the
eager forward's hidden states and KV writes, where it applies and where it does not, the
switch, and that it runs with the GIL released."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model.loader import load_model
from splitserve.engine.model.scripted_decode import (
    CPU_DECODE_FORWARD_ENV,
    cpu_decode_forward,
    decode_plan_applies,
)
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.ops.onednn_packed_weight import CPU_MATMUL_ENV
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import contiguous_metadata, make_checkpoint


def _decode_batch(model, config, context_lens, seed=0, kv_dtype="auto"):
    """A filled cache and one decode token per sequence: (ids, positions, cache, meta)."""
    generator = torch.Generator().manual_seed(seed)
    engine_config = EngineConfig(model="unused", num_kv_blocks=64, block_size=4, kv_cache_dtype=kv_dtype)
    cache = KVCache(config, engine_config)
    if not cache.quantized:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=generator))
    meta = contiguous_metadata(context_lens, [1] * len(context_lens), block_size=4, blocks_per_seq=8)
    ids = torch.randint(0, config.vocab_size, (len(context_lens),), generator=generator)
    positions = torch.tensor([c - 1 for c in context_lens])
    return ids, positions, cache, meta


def _both(model, ids, positions, cache, meta):
    """(eager hidden, eager cache, scripted hidden, scripted cache) from the same start."""
    start = cache.kv.clone()
    scripted = model._scripted_decode
    model._scripted_decode = None
    eager_hidden = model(ids, positions, cache, meta)
    eager_cache = cache.kv.clone()
    cache.kv.copy_(start)
    model._scripted_decode = scripted
    return eager_hidden, eager_cache, model(ids, positions, cache, meta), cache.kv.clone()


@pytest.mark.parametrize("matmul", ["onednn", "blas"])
# qwen2: a qkv bias and tied embeddings; qwen3: q/k norms; phi3: weights loaded from fused tensors;
# gemma3: (1 + w) and sandwich norms, GeGLU, scaled embeddings, sliding layers' own rotary;
# mixtral / qwen3_moe: the experts (routing, grouped matmuls, index_add_), qwen3_moe's dense layer
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe"])
def test_scripted_decode_is_bitwise_the_eager_forward(models_root, monkeypatch, matmul, arch):
    monkeypatch.setenv(CPU_MATMUL_ENV, matmul)
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)
    model, config = load_model(make_checkpoint(models_root, "tiny", arch))
    assert model._scripted_decode is not None and model._scripted_decode.graph.packed == (matmul == "onednn")
    for seed, lens in enumerate([[5, 17, 9], [32, 1, 30, 12, 4], [2, 2]]):
        ids, positions, cache, meta = _decode_batch(model, config, lens, seed)
        assert decode_plan_applies(meta, cache)
        eager_hidden, eager_cache, hidden, after = _both(model, ids, positions, cache, meta)
        assert torch.equal(hidden, eager_hidden)
        assert torch.equal(after, eager_cache)  # the new tokens' K/V, written in the same slots


def test_steps_the_scripted_forward_does_not_take(models_root, monkeypatch):
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)
    model, config = load_model(make_checkpoint(models_root, "tiny", "llama"))
    ids, positions, cache, meta = _decode_batch(model, config, [6])
    assert not decode_plan_applies(meta, cache)  # one sequence: the eager path's SDPA
    prefill = contiguous_metadata([6, 3], [6, 3], block_size=4, blocks_per_seq=8)
    assert not decode_plan_applies(prefill, cache)
    _, _, fp8_cache, fp8_meta = _decode_batch(model, config, [6, 9], kv_dtype="fp8")
    assert not decode_plan_applies(fp8_meta, fp8_cache)
    # Quantized weights, bf16 and the switch set to eager build no scripted forward.
    assert load_model(make_checkpoint(models_root, "tiny", "llama"), quantization="int8")[0]._scripted_decode is None
    assert load_model(make_checkpoint(models_root, "tiny", "llama"), dtype="bfloat16")[0]._scripted_decode is None
    monkeypatch.setenv(CPU_DECODE_FORWARD_ENV, "eager")
    assert load_model(make_checkpoint(models_root, "tiny", "llama"))[0]._scripted_decode is None


def test_a_per_layer_hook_runs_the_eager_forward(models_root, monkeypatch):
    """A KV sender ships each layer as it is written: the scripted call has no per-layer hook."""
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)
    model, config = load_model(make_checkpoint(models_root, "tiny", "llama"))
    ids, positions, cache, meta = _decode_batch(model, config, [7, 3])
    layers_done: list[int] = []
    model(ids, positions, cache, meta, on_layer_done=layers_done.append)
    assert layers_done == list(range(config.num_hidden_layers))


def test_a_bad_switch_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(CPU_DECODE_FORWARD_ENV, "jit")
    with pytest.raises(ValueError, match=f"{CPU_DECODE_FORWARD_ENV} must be one of scripted, eager, got 'jit'"):
        cpu_decode_forward()
    monkeypatch.setenv(CPU_DECODE_FORWARD_ENV, " Eager ")
    assert cpu_decode_forward() == "eager"


# gemma3: its greedy step soft-caps the logits; mixtral: the experts in the scripted step
@pytest.mark.parametrize("arch", ["llama", "gemma3", "mixtral"])
def test_scripted_and_eager_engines_generate_the_same(models_root, monkeypatch, arch):
    """Whole engines, both modes of the step: plain greedy (the one-call greedy step), greedy
    with log-probabilities and seeded sampling (the scripted forward, then the sampler) give the
    eager engine's tokens and log-probabilities."""
    path = str(make_checkpoint(models_root, "tiny", arch))
    prompts = [[5, 9, 14, 3, 22, 7], [11, 4, 30, 2], list(range(3, 40)), [8] * 9]
    kinds = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        "logprobs": SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=True),
        "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
    }
    runs = {}
    for forward in ("scripted", "eager"):
        monkeypatch.setenv(CPU_DECODE_FORWARD_ENV, forward)
        for async_scheduling in (False, True):
            engine = LLMEngine.from_model_dir(path, num_kv_blocks=64, async_scheduling=async_scheduling)
            assert (engine.model._scripted_decode is not None) == (forward == "scripted")
            for kind, params in kinds.items():
                outputs = engine.generate(prompts, params)
                runs[forward, async_scheduling, kind] = [(o.token_ids, o.logprobs) for o in outputs]
    for kind in kinds:
        assert runs["scripted", False, kind] == runs["eager", False, kind], kind
        assert runs["scripted", True, kind] == runs["eager", False, kind], kind


def _slot(cache, layer: int, plane: str, slot: int):
    """A numpy view of one cache slot (read without releasing the GIL)."""
    tensor = cache.key_cache(layer) if plane == "key" else cache.value_cache(layer)
    return tensor.view(tensor.shape[0] * tensor.shape[1], -1)[slot].numpy()


def _runs_on_while_the_gil_is_held(forward, first, last, seconds: float) -> bool | None:
    """Start forward() on a thread; as soon as this thread has the GIL back, keep it (spin in
    Python with a switch interval that forces no hand-off) for up to seconds, watching `last`
    (numpy views of cache memory the forward writes, read without releasing the GIL). True if
    `last` is written meanwhile: the forward ran on without the GIL. None (inconclusive) if the
    forward had already written `first` (its first layer's K) before this thread got the GIL."""
    finished: list[bool] = []
    started = threading.Event()

    def run() -> None:
        started.set()
        forward()
        finished.append(True)

    written = lambda view: any(view[j] != 0 for j in range(4))  # noqa: E731
    worker = threading.Thread(target=run, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        worker.start()
        assert started.wait(timeout=60)  # returns once the worker lets the GIL go
        result = None
        if not finished and not written(first):
            deadline = time.monotonic() + seconds
            result = False
            while not result and time.monotonic() < deadline:
                result = written(last)
    finally:
        sys.setswitchinterval(interval)
    worker.join(timeout=60)
    assert not worker.is_alive()
    return result


def _conclusive(forward, cache, config, slot: int, seconds: float) -> bool:
    first = _slot(cache, 0, "key", slot)
    last = _slot(cache, config.num_hidden_layers - 1, "value", slot)
    for _ in range(50):  # a busy machine may wake this thread only after the first layer
        first[:] = 0
        last[:] = 0
        result = _runs_on_while_the_gil_is_held(forward, first, last, seconds)
        if result is not None:
            return result
    pytest.fail("the forward was always past its first layer before this thread had the GIL back")


def test_the_scripted_step_runs_without_the_gil(models_root, monkeypatch):
    """The scripted greedy step writes every layer's K/V while another thread holds the GIL;
    the eager forward, which needs the GIL back after each op, gets no further than the op it
    is in. Deterministic: nothing here depends on how fast the machine is."""
    monkeypatch.delenv(CPU_DECODE_FORWARD_ENV, raising=False)
    model, config = load_model(make_checkpoint(models_root, "small", "llama"))
    ids, positions, cache, meta = _decode_batch(model, config, [29, 30, 31, 32, 27, 28, 26, 25])
    slot = int(meta.slot_mapping[-1])
    scripted = model._scripted_decode
    no_fill = torch.empty(0, dtype=torch.int64)
    step = lambda: scripted.greedy_step(ids, positions, cache, meta, no_fill, no_fill)  # noqa: E731
    step()  # TorchScript profiles its first runs
    tokens = step()
    assert _conclusive(step, cache, config, slot, seconds=60) is True
    model._scripted_decode = None
    assert _conclusive(lambda: model(ids, positions, cache, meta), cache, config, slot, seconds=0.5) is False
    # The step's tokens are the eager forward's greedy ones.
    assert tokens.tolist() == model.compute_logits(model(ids, positions, cache, meta)).argmax(-1).tolist()
