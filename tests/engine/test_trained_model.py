"""make-model --train-steps: a real (short) training run, its checkpoint, the cache and the draft preset."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import transformers

from splitserve.engine.builtin_models import model_cache, model_spec
from splitserve.engine.builtin_models.make_model import TRAINING_FILE, MakeModelError, ModelSpec, write_checkpoint
from splitserve.engine.builtin_models.make_model import main as make_model_main
from splitserve.engine.builtin_models.model_cache import cache_entry_path, cached_checkpoint
from splitserve.engine.model.loader import load_model
from tests.helpers.model import contiguous_metadata, greedy_generate, make_kv_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN_STEPS = 24
PROMPT = "It was the best of times, it was the worst of times, it was the age of wisdom"


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def trained(cache_root):
    """arch -> the cached checkpoint of a short tiny-preset training run, made once."""
    made = {}

    def get(arch: str):
        if arch not in made:
            made[arch] = cached_checkpoint(ModelSpec("tiny", arch, seed=5, train_steps=TRAIN_STEPS), root=cache_root)
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: tied embeddings and QKV bias
def test_short_training_lowers_loss_and_loads_in_both_loaders(trained, tmp_path, arch):
    cached = trained(arch)
    assert not cached.hit
    record = json.loads((cached.path / TRAINING_FILE).read_text())
    losses = record["losses"]
    assert len(losses) == TRAIN_STEPS and record["steps"] == TRAIN_STEPS
    assert record["cpu_s"] > 0 and record["wall_s"] > 0
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses

    random_dir = tmp_path / "random"
    write_checkpoint(ModelSpec("tiny", arch, seed=5), random_dir)
    assert (random_dir / "model.safetensors").read_bytes() != (cached.path / "model.safetensors").read_bytes()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (random_dir / name).read_bytes() == (cached.path / name).read_bytes(), name

    ids = transformers.AutoTokenizer.from_pretrained(cached.path)(PROMPT).input_ids
    model, _ = load_model(cached.path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(cached.path).eval()
    kv_cache, blocks_per_seq = make_kv_cache(model, len(ids))
    meta = contiguous_metadata([len(ids)], [len(ids)], 16, blocks_per_seq)
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv_cache, meta))
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
    # Greedy decoding through the paged cache follows transformers token for token.
    new_tokens = greedy_generate(model, ids, 16)
    with torch.no_grad():
        reference = hf.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert new_tokens == reference


def test_second_call_hits_the_cache(trained, cache_root, monkeypatch):
    first = trained("llama")
    monkeypatch.setattr("splitserve.engine.builtin_models.make_model.write_checkpoint", _must_not_write)
    again = cached_checkpoint(ModelSpec("tiny", "llama", seed=5, train_steps=TRAIN_STEPS), root=cache_root)
    assert again.hit and again.path == first.path
    assert again.path == cache_entry_path(ModelSpec("tiny", "llama", seed=5, train_steps=TRAIN_STEPS), cache_root)
    assert again.path.name == f"tiny-llama-trained{TRAIN_STEPS}"


def _must_not_write(*args, **kwargs):
    raise AssertionError("a cache hit must not write a checkpoint")


def test_cache_key_changes_with_every_input(monkeypatch):
    base = ModelSpec("small", "llama", seed=0, train_steps=100)
    variants = [
        ModelSpec("bench", "llama", seed=0, train_steps=100),
        ModelSpec("small", "qwen2", seed=0, train_steps=100),
        ModelSpec("small", "llama", seed=1, train_steps=100),
        ModelSpec("small", "llama", seed=0, train_steps=101),
        ModelSpec("small", "llama", seed=0, train_steps=0),
        ModelSpec("small", "llama", seed=0, train_steps=100, dtype="bfloat16"),
    ]
    keys = {base.cache_key()} | {v.cache_key() for v in variants}
    assert len(keys) == 1 + len(variants)
    assert base.cache_key() == ModelSpec("small", "llama", seed=0, train_steps=100).cache_key()
    monkeypatch.setattr(model_spec, "CORPUS_TEXT", model_spec.CORPUS_TEXT + " one more sentence.")
    assert base.cache_key() not in keys
    monkeypatch.undo()
    monkeypatch.setattr(model_spec, "RECIPE_VERSION", model_spec.RECIPE_VERSION + 1)
    assert base.cache_key() not in keys


def test_concurrent_makers_share_one_entry(tmp_path):
    spec = ModelSpec("tiny", "mistral", seed=3)  # random weights: cheap, same code path
    results, errors = [], []

    def make():
        try:
            results.append(cached_checkpoint(spec, root=tmp_path))
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 3
    assert sorted(r.hit for r in results) == [False, True, True]
    assert {r.path for r in results} == {cache_entry_path(spec, tmp_path)}
    load_model(results[0].path)
    leftovers = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")]
    assert leftovers == [spec.cache_key()]


def test_a_failed_make_leaves_no_entry(tmp_path, monkeypatch):
    spec = ModelSpec("tiny", "llama", seed=4)

    def fail_half_way(spec_, out_dir, **kwargs):
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr("splitserve.engine.builtin_models.make_model.write_checkpoint", fail_half_way)
    with pytest.raises(RuntimeError, match="disk full"):
        cached_checkpoint(spec, root=tmp_path)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    assert not cached_checkpoint(spec, root=tmp_path).hit


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(train_steps=-1), "train_steps must be >= 0"),
        (dict(train_steps=2.5), "train_steps must be an integer"),
        (dict(train_steps=True), "train_steps must be an integer"),
        (dict(seed=-3), "seed must be >= 0"),
        (dict(preset="huge"), "unknown preset 'huge'; choose from tiny, small, bench, draft"),
        (dict(arch="gpt2"), "unknown arch"),
        (dict(num_shards=0), "num_shards must be >= 1"),
    ],
)
def test_bad_specs_are_rejected_clearly(kwargs, message):
    with pytest.raises(MakeModelError, match=message.replace("(", r"\(")):
        ModelSpec(**kwargs)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--train-steps", "-5"], "train_steps must be >= 0"),
        (["--train-steps", "3", "--train-threads", "0"], "--train-threads must be >= 1"),
        (["--seed", "-1"], "seed must be >= 0"),
    ],
)
def test_cli_rejects_bad_arguments(tmp_path, capsys, flags, message):
    out = tmp_path / "never"
    assert make_model_main([str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_cli_trains_through_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path / "cache"))
    argv = ["--preset", "tiny", "--train-steps", "3", "--seed", "7"]
    assert make_model_main([str(tmp_path / "a"), *argv]) == 0
    assert "trained and cached" in capsys.readouterr().out
    assert make_model_main([str(tmp_path / "b"), *argv]) == 0
    assert "cache hit" in capsys.readouterr().out
    for name in ("model.safetensors", "config.json", "tokenizer.json", TRAINING_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert make_model_main([str(tmp_path / "c"), *argv, "--no-cache"]) == 0
    assert "not cached" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "c" / TRAINING_FILE).read_text())["losses"]) == 3
    # Training is deterministic on one machine (same seed, data order and thread count).
    assert (tmp_path / "c" / "model.safetensors").read_bytes() == (tmp_path / "a" / "model.safetensors").read_bytes()


def test_draft_shares_its_targets_tokenizer_exactly(tmp_path):
    draft = tmp_path / "draft"
    write_checkpoint(ModelSpec("draft", "llama"), draft)
    draft_config = json.loads((draft / "config.json").read_text())
    for target_preset in ("small", "bench"):
        target = tmp_path / target_preset
        write_checkpoint(ModelSpec(target_preset, "llama"), target)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (draft / name).read_bytes() == (target / name).read_bytes(), (target_preset, name)
        target_config = json.loads((target / "config.json").read_text())
        for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
            assert draft_config[key] == target_config[key], key
        assert draft_config["num_hidden_layers"] < target_config["num_hidden_layers"] or (
            draft_config["hidden_size"] < target_config["hidden_size"]
        )
    model, _ = load_model(draft)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_corpus_batches_rows():
    from splitserve.engine.builtin_models.corpus_batches import IGNORE_INDEX, CorpusBatches
    from splitserve.engine.builtin_models.corpus_tokenizer import train_tokenizer

    tokenizer = train_tokenizer(512)
    windows = CorpusBatches(tokenizer, seq_len=32, seed=0, copy_fraction=0.0, max_span_tokens=8)
    inputs, labels = windows.sample(4)
    assert inputs.shape == labels.shape == (4, 32)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])  # next-token labels, nothing masked
    copies = CorpusBatches(tokenizer, seq_len=32, seed=0, copy_fraction=1.0, max_span_tokens=8)
    inputs, labels = copies.sample(4)
    separator = copies.separator
    for row_inputs, row_labels in zip(inputs.tolist(), labels.tolist()):
        assert row_inputs[0] == copies.bos_id
        first_sep = next(i for i in range(len(row_inputs)) if row_inputs[i : i + len(separator)] == separator)
        span = row_inputs[1:first_sep]
        repeat = row_inputs[first_sep + len(separator) : first_sep + len(separator) + len(span)]
        assert repeat == span[: len(repeat)] and len(repeat) > 0
        # The quoted span and the separators carry no loss; the repeats do.
        assert all(label == IGNORE_INDEX for label in row_labels[: first_sep + len(separator) - 1])
        assert row_labels[first_sep + len(separator) - 1] == span[0]
    with pytest.raises(ValueError, match="copy_fraction"):
        CorpusBatches(tokenizer, seq_len=32, seed=0, copy_fraction=1.5)
    with pytest.raises(ValueError, match="max_span_tokens"):
        CorpusBatches(tokenizer, seq_len=32, seed=0, max_span_tokens=40)
