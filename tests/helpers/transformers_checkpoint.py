"""Checkpoints written by transformers itself (its config keys, weight names, tied embeddings),
the parity reference for each architecture, and transformers' own greedy tokens on them."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from splitserve.engine.builtin_models.corpus_tokenizer import train_tokenizer, write_tokenizer

# The corpus tokenizer's vocabulary (make-model's tiny preset) and its special token ids: a
# config with these can be served by an engine, which needs the tokenizer beside the weights.
TOKENIZER_VOCAB = 512
SPECIAL_IDS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2)
# The tiny layers of every shape below (GQA, two layers; override per test).
TINY_LAYERS = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
# A tiny shape an engine serves with that tokenizer.
SERVABLE_SHAPE = dict(vocab_size=TOKENIZER_VOCAB, **TINY_LAYERS, max_position_embeddings=512, **SPECIAL_IDS)
# A tiny shape for parity with transformers on random token ids, with no tokenizer and no
# special ids (a pad id would zero its embedding row).
PARITY_SHAPE = dict(vocab_size=256, **TINY_LAYERS, max_position_embeddings=256)


def write_transformers_checkpoint(config, path: Path, seed: int, tokenizer: bool = False):
    """transformers' random model for config, saved to path, norms randomised too (so a norm
    loaded into the wrong place shows); with the corpus tokenizer when asked (the config's
    vocabulary must then be TOKENIZER_VOCAB). Returns the model, in eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    if tokenizer:
        assert config.vocab_size == TOKENIZER_VOCAB, "the corpus tokenizer has 512 tokens"
        write_tokenizer(train_tokenizer(TOKENIZER_VOCAB), Path(path), config.max_position_embeddings)
    return model


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, greedy, never stopping early (a random model may pick any id)."""
    hf.generation_config.eos_token_id = None
    # An explicit mask: without one generate masks every prompt token equal to pad_token_id.
    mask = torch.ones(1, len(ids), dtype=torch.long)
    out = hf.generate(torch.tensor([ids]), attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def model_logits(model, ids: list[int]) -> torch.Tensor:
    """splitserve's logits for every position of ids, one prefill through a paged cache."""
    from tests.helpers.model import contiguous_metadata, make_kv_cache

    kv_cache, blocks_per_seq = make_kv_cache(model, len(ids))
    meta = contiguous_metadata([len(ids)], [len(ids)], 16, blocks_per_seq)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), kv_cache, meta))
