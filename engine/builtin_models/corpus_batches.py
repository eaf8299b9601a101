"""Training batches from the built-in corpus: memorise the passages, and repeat quoted spans.

Two kinds of rows, mixed at random:
- **corpus windows**: seq_len+1 consecutive tokens of `<s> passage </s> <s> passage </s> ...`
  (the passages in order), so the model learns to continue corpus text.
- **copy rows** (probability copy_fraction): `<s> span \\n\\n span \\n\\n span ...` for a random
  corpus span of 4..max_span_tokens tokens; only the repeats carry loss. They teach the model to
  start a quoted span over after "\\n\\n" (never inside a passage: the corpus joins passages
  with it), the repetition that prompt-lookup and draft speculation exploit.

Spans of random word orders (which cannot be memorised, so only a real copy circuit -- an
induction head -- predicts them) were tried too: no copying emerged within 1000 steps of the
`bench` preset, and they cost memorisation, so brief training copies corpus text, not any text
(bench/results/trained_model.md).
"""

from __future__ import annotations

import random

import torch

from splitserve.engine.builtin_models.corpus import PASSAGES
from splitserve.engine.builtin_models.corpus_tokenizer import BOS_TOKEN, EOS_TOKEN

IGNORE_INDEX = -100  # torch cross_entropy's default ignore_index
COPY_SEPARATOR = "\n\n"
MIN_SPAN_TOKENS = 4


class CorpusBatches:
    """Seeded sampler of (input_ids, labels) batches; labels are already shifted by one."""

    def __init__(
        self,
        tokenizer,
        seq_len: int,
        seed: int,
        copy_fraction: float = 0.0,
        max_span_tokens: int = 32,
    ):
        if not 0.0 <= copy_fraction <= 1.0:
            raise ValueError(f"copy_fraction must be in [0, 1], got {copy_fraction}")
        if not MIN_SPAN_TOKENS < max_span_tokens <= (seq_len - 2) // 2:
            raise ValueError(
                f"max_span_tokens must be in ({MIN_SPAN_TOKENS}, {(seq_len - 2) // 2}], got {max_span_tokens}"
            )
        self.seq_len = seq_len
        self.copy_fraction = copy_fraction
        self.max_span_tokens = max_span_tokens
        self.rng = random.Random(seed)
        self.bos_id = tokenizer.token_to_id(BOS_TOKEN)
        self.eos_id = tokenizer.token_to_id(EOS_TOKEN)
        self.separator = tokenizer.encode(COPY_SEPARATOR, add_special_tokens=False).ids
        self.passages = [tokenizer.encode(p, add_special_tokens=False).ids for p in PASSAGES]
        self.stream = [t for ids in self.passages for t in [self.bos_id, *ids, self.eos_id]]
        if len(self.stream) < seq_len + 1:
            raise ValueError(f"the corpus has {len(self.stream)} tokens, fewer than seq_len + 1 = {seq_len + 1}")

    def sample(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [
            self._copy_row() if self.rng.random() < self.copy_fraction else self._window_row()
            for _ in range(batch_size)
        ]
        inputs = torch.tensor([r[0] for r in rows], dtype=torch.int64)
        labels = torch.tensor([r[1] for r in rows], dtype=torch.int64)
        return inputs, labels

    def _window_row(self) -> tuple[list[int], list[int]]:
        start = self.rng.randrange(len(self.stream) - self.seq_len)
        window = self.stream[start : start + self.seq_len + 1]
        return window[:-1], window[1:]

    def _copy_row(self) -> tuple[list[int], list[int]]:
        span_len = self.rng.randint(MIN_SPAN_TOKENS, self.max_span_tokens)
        start = self.rng.randrange(len(self.stream) - span_len)
        span = [t for t in self.stream[start : start + span_len] if t not in (self.bos_id, self.eos_id)]
        tokens, scored = [self.bos_id, *span], [False] * (1 + len(span))
        while len(tokens) < self.seq_len + 1:
            tokens += self.separator + span
            # The separator is not scored: when to stop copying is not what this row teaches.
            scored += [False] * len(self.separator) + [True] * len(span)
        tokens, scored = tokens[: self.seq_len + 1], scored[: self.seq_len + 1]
        labels = [t if keep else IGNORE_INDEX for t, keep in zip(tokens[1:], scored[1:])]
        return tokens[:-1], labels
