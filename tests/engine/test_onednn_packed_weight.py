"""The CPU matmul weights packed for oneDNN (engine/ops/onednn_packed_weight.py): the same
products as F.linear, what gets packed at load, the blas switch, and a packed model's outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model.layers import DecoderLayer
from splitserve.engine.model.loader import load_model
from splitserve.engine.ops.onednn_packed_weight import CPU_MATMUL_ENV, OneDnnPackedWeight, cpu_matmul
from splitserve.engine.quant.quantize import linear, weight_bytes
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.model import make_checkpoint

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 33, 300])
def test_packed_product_matches_f_linear(dtype, tolerance, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator).to(dtype)
    x = torch.randn(rows, 80, generator=generator).to(dtype)
    packed = OneDnnPackedWeight.pack(weight)
    assert packed is not None and packed.shape == weight.shape and packed.dtype == dtype
    expected = F.linear(x.float(), weight.float())
    got = packed(x)
    assert got.shape == (rows, 96) and got.dtype == dtype
    assert (got.float() - expected).abs().max() <= tolerance * expected.abs().max()
    assert torch.equal(packed.dense(), weight)
    bias = torch.randn(96, generator=generator).to(dtype)
    assert torch.allclose(linear(x, packed, bias).float(), (got + bias).float(), atol=1e-6)


def test_what_cannot_be_packed_stays_plain():
    assert OneDnnPackedWeight.pack(torch.randn(8, 4, dtype=torch.float16)) is None  # no fp16 kernels here
    assert OneDnnPackedWeight.pack(torch.randn(8)) is None
    assert OneDnnPackedWeight.pack(torch.empty(8, 4, device="meta")) is None
    packed = OneDnnPackedWeight.pack(torch.randn(8, 4))
    with pytest.raises(TypeError, match="bfloat16"):
        packed(torch.randn(2, 4, dtype=torch.bfloat16))


def test_load_packs_every_full_precision_matmul_and_blas_keeps_them_plain(models_root, monkeypatch):
    path = make_checkpoint(models_root, "tiny", "llama")
    monkeypatch.delenv(CPU_MATMUL_ENV, raising=False)
    packed_model, config = load_model(path)
    assert not config.tie_word_embeddings
    for layer in packed_model.layers:
        assert all(isinstance(getattr(layer, n), OneDnnPackedWeight) for n in DecoderLayer.LINEAR_WEIGHTS)
    assert isinstance(packed_model.lm_head, OneDnnPackedWeight)
    monkeypatch.setenv(CPU_MATMUL_ENV, "blas")
    plain_model, _ = load_model(path)
    for layer in plain_model.layers:
        assert all(isinstance(getattr(layer, n), torch.nn.Parameter) for n in DecoderLayer.LINEAR_WEIGHTS)
    # The packed weights hold the loaded values, and count as many bytes as the plain ones.
    assert torch.equal(packed_model.layers[0].qkv_weight.dense(), plain_model.layers[0].qkv_weight)
    assert weight_bytes(packed_model) == weight_bytes(plain_model)


def test_tied_lm_head_and_quantized_weights_are_not_packed(models_root, monkeypatch):
    monkeypatch.delenv(CPU_MATMUL_ENV, raising=False)
    tied, config = load_model(make_checkpoint(models_root, "tiny", "qwen2"))
    assert config.tie_word_embeddings and tied.lm_head is tied.embed_tokens
    assert isinstance(tied.layers[0].qkv_weight, OneDnnPackedWeight)
    quantized, _ = load_model(make_checkpoint(models_root, "tiny", "llama"), quantization="int8")
    assert not isinstance(quantized.layers[0].qkv_weight, OneDnnPackedWeight)
    assert isinstance(quantized.lm_head, OneDnnPackedWeight)  # lm_head stays in full precision


def test_a_bad_switch_value_is_a_clear_error(models_root, monkeypatch):
    monkeypatch.setenv(CPU_MATMUL_ENV, "mkl")
    with pytest.raises(ValueError, match=f"{CPU_MATMUL_ENV} must be one of onednn, blas, got 'mkl'"):
        cpu_matmul()
    monkeypatch.setenv(CPU_MATMUL_ENV, " BLAS ")
    assert cpu_matmul() == "blas"


def test_packed_and_plain_engines_agree(models_root, monkeypatch):
    """Same checkpoint, both matmuls: the logits agree to float rounding and greedy text matches."""
    path = str(make_checkpoint(models_root, "tiny", "llama"))
    prompts = [[5, 9, 14, 3, 22, 7], [11, 4, 30, 2], list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)
    runs = {}
    for matmul in ("onednn", "blas"):
        monkeypatch.setenv(CPU_MATMUL_ENV, matmul)
        engine = LLMEngine.from_model_dir(path, num_kv_blocks=64, async_scheduling=False)
        runs[matmul] = engine.generate(prompts, params)
    for packed, plain in zip(runs["onednn"], runs["blas"]):
        assert packed.token_ids == plain.token_ids
        diffs = [abs(a - b) for a, b in zip(packed.logprobs, plain.logprobs)]
        assert max(diffs) < 1e-3
