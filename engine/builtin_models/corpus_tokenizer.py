"""The byte-level BPE tokenizer every make-model checkpoint ships, trained on the built-in corpus.

Checkpoints with the same vocabulary size get byte-identical tokenizer files, which is what
lets a draft model share its target's tokenizer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from splitserve.engine.builtin_models.corpus import TEXT as CORPUS_TEXT

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]  # ids 0..4
# ChatML turns; bos first like Llama 3, so a rendered chat prompt is encoded with
# add_special_tokens=False (what HF's apply_chat_template(tokenize=True) does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2/Llama-3 style) trained on the built-in corpus."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


@functools.cache
def _trained_tokenizer_json(vocab_size: int) -> str:
    # Training is deterministic but takes a second; tests write many checkpoints.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS_TEXT.split("\n\n"), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer.to_str()


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_tokenizer(tokenizer, out_dir: Path, max_len: int) -> dict[str, int]:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    added = {
        str(ids[tok]): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
            "added_tokens_decoder": added,
            "clean_up_tokenization_spaces": False,
            "model_max_length": max_len,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    write_json(
        out_dir / "special_tokens_map.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "additional_special_tokens": [IM_START, IM_END],
        },
    )
    return ids
