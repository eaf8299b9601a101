"""The paged-KV model matches Hugging Face transformers on random checkpoints (tiny preset)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # a test dependency: a broken install must fail, not skip
from safetensors.torch import load_file, save_file

from splitserve.engine.builtin_models.make_model import MakeModelError, write_random_checkpoint
from splitserve.engine.builtin_models.make_model import main as make_model_main
from splitserve.engine.config import ConfigError
from splitserve.engine.model.checkpoint import CheckpointError
from splitserve.engine.model.loader import load_model
from splitserve.engine.ops.attention import paged_decode_attention_torch, write_kv
from tests.helpers.model import (
    contiguous_metadata,
    greedy_generate,
    make_checkpoint,
    make_kv_cache,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


ARCH_CASES = {
    "llama": dict(arch="llama", seed=1),
    "mistral": dict(arch="mistral", seed=2),
    "qwen2": dict(arch="qwen2", seed=3),
    "qwen3": dict(arch="qwen3", seed=5),
    "phi3": dict(arch="phi3", seed=6),
    "gemma3": dict(arch="gemma3", seed=7),
    "llama3-rope": dict(arch="llama", seed=4, rope_scaling=True),
}
PROMPT = "The quick brown fox jumps over the lazy dog. It was the best of times. " * 6


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def loaded(models_root):
    """case -> (checkpoint dir, our model, HF model, HF tokenizer), loaded once per module."""
    cache = {}

    def get(case: str):
        if case not in cache:
            kwargs = dict(ARCH_CASES[case])
            path = make_checkpoint(models_root, "tiny", kwargs.pop("arch"), **kwargs)
            model, _ = load_model(path)
            hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            hf_tok = transformers.AutoTokenizer.from_pretrained(path)
            cache[case] = (path, model, hf, hf_tok)
        return cache[case]

    return get


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_make_model_is_deterministic_and_loads(models_root, tmp_path):
    first = make_checkpoint(models_root, "tiny", "llama", seed=1)
    second = tmp_path / "again"
    assert make_model_main([str(second), "--preset", "tiny", "--arch", "llama", "--seed", "1"]) == 0
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    ):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = write_random_checkpoint(tmp_path / "seed9", preset="tiny", seed=9)
    assert (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    config = json.loads((first / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (64, 2, 16)
    assert config["vocab_size"] == transformers.AutoTokenizer.from_pretrained(first).__len__()
    with pytest.raises(MakeModelError):
        write_random_checkpoint(tmp_path / "bad", preset="huge")


@pytest.mark.parametrize("case", list(ARCH_CASES))
def test_prefill_logits_match_transformers(loaded, case):
    path, model, hf, hf_tok = loaded(case)
    expected_class = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "phi3": "Phi3ForCausalLM",
        "gemma3": "Gemma3ForCausalLM",
    }[ARCH_CASES[case]["arch"]]
    assert type(hf).__name__ == expected_class
    ids = hf_tok(PROMPT).input_ids
    assert len(ids) > 100
    kv_cache, blocks_per_seq = make_kv_cache(model, len(ids))
    meta = contiguous_metadata([len(ids)], [len(ids)], 16, blocks_per_seq)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), kv_cache, meta)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_chunked_prefill_and_mixed_batch_match_transformers(loaded):
    """A prompt prefilled in two chunks (the second attends to a cached prefix), batched with
    decode tokens of other sequences, gives the same logits as one full forward."""
    _, model, hf, hf_tok = loaded("llama")
    ids_a = hf_tok(PROMPT).input_ids[:70]
    ids_b = hf_tok("Call me Ishmael. Some years ago, never mind how long").input_ids
    ids_c = hf_tok("In the beginning God created the heaven and the earth.").input_ids
    kv_cache, per_seq = make_kv_cache(model, 80, num_seqs=3)
    # Step 1: prefill a[:40], b[:-1], c[:-1] together.
    lens = [40, len(ids_b) - 1, len(ids_c) - 1]
    meta = contiguous_metadata(lens, lens, 16, per_seq)
    tokens = ids_a[:40] + ids_b[:-1] + ids_c[:-1]
    positions = [p for n in lens for p in range(n)]
    model(torch.tensor(tokens), torch.tensor(positions), kv_cache, meta)
    # Step 2: decode b and c (one token each, a run of two decodes) next to the second chunk
    # of a; the batch order differs from the block ranges they own.
    ctx = [len(ids_b), len(ids_c), 70]
    meta = contiguous_metadata(ctx, [1, 1, 30], 16, per_seq, block_ranges=[1, 2, 0])
    tokens = ids_b[-1:] + ids_c[-1:] + ids_a[40:70]
    positions = [len(ids_b) - 1, len(ids_c) - 1] + list(range(40, 70))
    logits = model.compute_logits(model(torch.tensor(tokens), torch.tensor(positions), kv_cache, meta))
    torch.testing.assert_close(logits[0], _hf_logits(hf, ids_b)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[1], _hf_logits(hf, ids_c)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(logits[2:], _hf_logits(hf, ids_a)[40:70], atol=1e-4, rtol=0)
    # Step 3: a pure decode step of all three (the layers share one decode plan).
    extra = 100
    ctx = [71, len(ids_c) + 1, len(ids_b) + 1]
    meta = contiguous_metadata(ctx, [1, 1, 1], 16, per_seq, block_ranges=[0, 2, 1])
    positions = [c - 1 for c in ctx]
    logits = model.compute_logits(model(torch.tensor([extra] * 3), torch.tensor(positions), kv_cache, meta))
    for row, ids in enumerate([ids_a, ids_c, ids_b]):
        torch.testing.assert_close(logits[row], _hf_logits(hf, ids + [extra])[-1], atol=1e-4, rtol=0)
    logits.div_(2.0)  # a normal tensor: samplers may edit logits in place


@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2"])
def test_greedy_matches_transformers_generate(loaded, case):
    _, model, hf, hf_tok = loaded(case)
    prompt = hf_tok("Hello, how are you today? I am fine").input_ids
    num_new = 72
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=num_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=hf_tok.pad_token_id,
        )
    expected = out[0, len(prompt) :].tolist()
    mine = greedy_generate(model, prompt, num_new)
    assert mine == expected
    assert len(set(mine)) > 8  # a random model that just repeats one token would prove little


def test_sharded_checkpoint_loads_and_matches_single_file(models_root, loaded):
    path, model, hf, _ = loaded("qwen2")
    sharded = make_checkpoint(models_root, "tiny", "qwen2", seed=3, num_shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-0000?-of-00003.safetensors"))) == 3
    model_sharded, config = load_model(sharded)
    assert config.tie_word_embeddings and config.attention_bias
    for a, b in zip(model.state_dict().values(), model_sharded.state_dict().values()):
        assert torch.equal(a, b)
    hf_sharded = transformers.AutoModelForCausalLM.from_pretrained(sharded)
    ids = list(range(5, 40))
    torch.testing.assert_close(_hf_logits(hf_sharded, ids), _hf_logits(hf, ids), atol=0, rtol=0)


def test_on_layer_done_runs_after_each_layers_kv_is_written(loaded):
    _, model, _, hf_tok = loaded("llama")
    ids = hf_tok(PROMPT).input_ids[:20]
    kv_cache, per_seq = make_kv_cache(model, len(ids))
    meta = contiguous_metadata([len(ids)], [len(ids)], 16, per_seq)
    seen = []

    def on_layer_done(layer: int) -> None:
        written = kv_cache.key_cache(layer).reshape(-1, model.config.num_key_value_heads, model.config.head_dim)[
            meta.slot_mapping
        ]
        not_yet = [kv_cache.key_cache(i).abs().sum().item() for i in range(layer + 1, 2)]
        seen.append((layer, bool(written.abs().sum() > 0), not_yet))

    model(torch.tensor(ids), torch.arange(len(ids)), kv_cache, meta, on_layer_done=on_layer_done)
    assert seen == [(0, True, [0.0]), (1, True, [])]


def test_bfloat16_load_is_close_to_float32(loaded):
    path, model, _, hf_tok = loaded("qwen2")
    model_bf16, config = load_model(path, dtype="bfloat16")
    assert config.dtype == "bfloat16" and model_bf16.embed_tokens.dtype == torch.bfloat16
    ids = hf_tok(PROMPT).input_ids[:40]
    results = []
    for m in (model, model_bf16):
        kv_cache, per_seq = make_kv_cache(m, len(ids))
        meta = contiguous_metadata([len(ids)], [len(ids)], 16, per_seq)
        results.append(m.compute_logits(m(torch.tensor(ids), torch.arange(len(ids)), kv_cache, meta)))
    assert results[1].dtype == torch.float32
    agree = (results[0].argmax(-1) == results[1].argmax(-1)).float().mean().item()
    assert agree > 0.8


@pytest.mark.parametrize("num_seqs,sparse", [(4, True), (5, False), (1, True)])
def test_paged_decode_attention_matches_reference(monkeypatch, num_seqs, sparse):
    """Random block tables and context lengths: the in-place sparse CPU path, the gather +
    SDPA path (bf16, CUDA without Triton), and batch 1."""
    from splitserve.engine.ops import attention

    if not sparse:
        monkeypatch.setattr(attention, "sparse_decode_supported", lambda q, cache: False)
    gen = torch.Generator().manual_seed(num_seqs)
    num_blocks, block_size, kv_heads, heads, dim = 40, 4, 2, 6, 8
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    context_lens = [1, 7, 13, 4, 16][:num_seqs] if num_seqs > 1 else [11]
    tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * 4].view(num_seqs, 4).to(torch.int32)
    keys = [torch.randn(n, kv_heads, dim, generator=gen) for n in context_lens]
    values = [torch.randn(n, kv_heads, dim, generator=gen) for n in context_lens]
    for seq, n in enumerate(context_lens):
        slots = torch.tensor([int(tables[seq, p // block_size]) * block_size + p % block_size for p in range(n)])
        write_kv(key_cache, value_cache, keys[seq], values[seq], slots)
    q = torch.randn(num_seqs, heads, dim, generator=gen)
    out = paged_decode_attention_torch(
        q, key_cache, value_cache, tables, torch.tensor(context_lens, dtype=torch.int32), 0.3
    )
    for seq in range(num_seqs):
        k = keys[seq].repeat_interleave(heads // kv_heads, dim=1)  # [n, H, D]
        v = values[seq].repeat_interleave(heads // kv_heads, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[seq], k) * 0.3).softmax(-1)
        torch.testing.assert_close(out[seq], torch.einsum("hn,nhd->hd", probs, v))


def _broken_copy(models_root, tmp_path, name: str):
    src = make_checkpoint(models_root, "tiny", "llama", seed=1)
    dst = tmp_path / name
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_clear_checkpoint_errors(models_root, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")

    no_config = _broken_copy(models_root, tmp_path, "no_config")
    (no_config / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(no_config)

    no_weights = _broken_copy(models_root, tmp_path, "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(no_weights)

    missing_one = _broken_copy(models_root, tmp_path, "missing_one")
    tensors = load_file(missing_one / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing_one / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(missing_one)

    unsupported = _broken_copy(models_root, tmp_path, "unsupported")
    config = json.loads((unsupported / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (unsupported / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_model(unsupported)

    wrong_shape = _broken_copy(models_root, tmp_path, "wrong_shape")
    config = json.loads((wrong_shape / "config.json").read_text())
    config["intermediate_size"] = 96
    (wrong_shape / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.\w+_proj\.weight has shape \(\d+, \d+\), config.json implies"):
        load_model(wrong_shape)


def test_missing_shard_is_reported(models_root, tmp_path):
    src = make_checkpoint(models_root, "tiny", "qwen2", seed=3, num_shards=3)
    dst = tmp_path / "sharded"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model-00002-of-00003.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        load_model(dst)
