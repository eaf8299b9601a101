"""splitserve.engine.io.tokenizer / splitserve.engine.io.detokenizer agree with transformers' AutoTokenizer."""

from __future__ import annotations

import json

import pytest
import transformers  # a test dependency: a broken install must fail, not skip

from splitserve.engine.io.detokenizer import IncrementalDetokenizer
from splitserve.engine.io.tokenizer import Tokenizer, TokenizerError
from splitserve.engine.model.checkpoint import CheckpointError
from tests.helpers.model import make_checkpoint

TEXTS = [
    "Hello world",
    "héllo wörld 日本語 🙂",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "Numbers 1234567890 and symbols !@#$%^&*()",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan? 日本"},
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("models"), "tiny", "llama", seed=1)


@pytest.fixture(scope="module")
def tokenizers(checkpoint):
    return Tokenizer.from_pretrained(checkpoint), transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizers, text):
    ours, hf = tokenizers
    for add_special in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special)
        assert ids == hf(text, add_special_tokens=add_special).input_ids
    ids = ours.encode(text)
    assert ids[0] == ours.bos_token_id
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_ids_and_vocab(tokenizers, checkpoint):
    ours, hf = tokenizers
    assert ours.bos_token_id == hf.bos_token_id == 0
    assert ours.eos_token_id == hf.eos_token_id
    config = json.loads((checkpoint / "config.json").read_text())
    assert ours.eos_token_ids == config["eos_token_id"]  # </s> and <|im_end|>
    assert ours.vocab_size == len(hf) == config["vocab_size"]
    assert ours.id_to_token(ours.bos_token_id) == "<s>"
    assert ours.token_to_id("<|im_end|>") in ours.eos_token_ids


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizers, add_generation_prompt):
    ours, hf = tokenizers
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text.startswith("<s><|im_start|>system\nYou are terse.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ids == list(hf_ids)
    assert ids.count(ours.bos_token_id) == 1


def test_missing_chat_template_and_tokenizer_file_are_clear_errors(checkpoint, tmp_path):
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in checkpoint.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat_template"):
        Tokenizer.from_pretrained(copy).apply_chat_template(MESSAGES)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(copy)


def _stream(tokenizer, ids, prompt_ids=None):
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_ids)
    deltas = [detok.add_token(t) for t in ids]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("text", ["héllo wörld 日本語 🙂", "Café ✨ naïve 한국어 👍🚀 done."])
def test_incremental_detokenizer_handles_split_utf8(tokenizers, text):
    ours, _ = tokenizers
    ids = ours.encode(text, add_special_tokens=False)
    # Byte-level BPE splits the rarer multi-byte characters across tokens.
    assert any("\ufffd" in ours.decode([t]) for t in ids)
    detok, deltas = _stream(ours, ids, prompt_ids=ours.encode("Say it:"))
    assert "".join(deltas) == detok.text == text == ours.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    assert deltas[-1] == ""  # nothing was left held back


def test_incremental_detokenizer_on_arbitrary_ids_equals_full_decode(tokenizers):
    """Random models emit arbitrary ids, including lone UTF-8 fragments and special tokens."""
    ours, _ = tokenizers
    import random

    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 60))]
        detok, deltas = _stream(ours, ids)
        assert "".join(deltas) == detok.text == ours.decode(ids)
        assert detok.output_token_ids == ids
