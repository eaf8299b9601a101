"""The logits-mask step of constrained decoding, applied to a whole batch before sampling.

Per step: start() hands the batch's matchers to llguidance's executor on a helper thread
while the model runs (the next-token masks depend only on tokens already accepted, and
llguidance computes them in Rust without the GIL), and apply() waits for the masks and applies
them to the constrained rows of the logits in one bitmask op. The scheduler then advances each
matcher by the tokens its request emits. A batch without constrained requests costs one list scan.

Speculative decoding: a sequence verifying draft d_1..d_k has k + 1 logits rows; row j gets
the mask of the grammar state after d_1..d_j. The helper thread walks the draft (mask, accept
d_{j+1}, ...) and rolls the matcher back, so the verifier samples every row under its own
mask. Drafts are cut to their grammar-valid prefix before the step (spec/speculator.py).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from splitserve.engine.structured_output.token_bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_,
    bitmask_words,
)


class GrammarMask:
    def __init__(self, vocab_size: int, num_threads: int = 1):
        self.vocab_size = vocab_size
        self.num_threads = num_threads
        self._executor = None  # llguidance.LLExecutor, created on the first constrained step
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._rows: list[int] = []
        self._bitmask: torch.Tensor | None = None
        self.num_steps = 0  # steps that masked at least one row
        self.num_masked_rows = 0
        self.mask_seconds = 0.0  # time the step waited for masks and applied them
        self.fill_seconds = 0.0  # time computing masks (overlapped with the forward pass)

    def start(self, seqs: list, drafts: list[list[int]] | None = None) -> None:
        """Begin computing the masks of the constrained seqs. Logits rows follow seqs, seq i
        taking len(drafts[i]) + 1 rows (one row each without drafts)."""
        self._pending = None
        drafts = drafts or [[] for _ in seqs]
        plain, walks, rows = [], [], []
        row = 0
        for seq, draft in zip(seqs, drafts):
            if seq.grammar is not None:
                if draft:
                    walks.append((seq.grammar, draft, len(rows)))
                    rows.extend(range(row, row + len(draft) + 1))
                else:
                    plain.append((seq.grammar.ll_matcher, len(rows)))
                    rows.append(row)
            row += len(draft) + 1
        if not rows:
            return
        if self._pool is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = allocate_token_bitmask(max(len(rows), 8), self.vocab_size)
        self._rows = rows
        self._pending = self._pool.submit(self._fill, plain, walks, self._bitmask)

    def _fill(self, plain: list, walks: list, bitmask: torch.Tensor) -> None:
        start = time.perf_counter()
        row_bytes = 4 * bitmask_words(self.vocab_size)
        if len(plain) == 1:
            matcher, row = plain[0]
            matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * row_bytes, row_bytes)
        elif plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
        for grammar, draft, first_row in walks:
            num_accepted = 0
            for j in range(len(draft) + 1):
                grammar.ll_matcher.unsafe_compute_mask_ptr(bitmask.data_ptr() + (first_row + j) * row_bytes, row_bytes)
                if j == len(draft) or grammar.accept_tokens(draft[j : j + 1]) != 1:
                    break
                num_accepted += 1
            grammar.rollback(num_accepted)
        self.fill_seconds += time.perf_counter() - start

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask the constrained rows of logits [len(seqs), vocab] in place (waits for start())."""
        if self._pending is None:
            return logits
        start = time.perf_counter()
        pending, self._pending = self._pending, None
        pending.result()
        num = len(self._rows)
        bitmask = self._bitmask[:num]
        if num == logits.shape[0]:
            apply_token_bitmask_(logits, bitmask)
        else:
            index = torch.tensor(self._rows, device=logits.device)
            logits.index_copy_(0, index, apply_token_bitmask_(logits.index_select(0, index), bitmask))
        self.num_steps += 1
        self.num_masked_rows += num
        self.mask_seconds += time.perf_counter() - start
        return logits

    def stats(self) -> dict[str, float]:
        return {
            "grammar_mask_steps": self.num_steps,
            "grammar_masked_rows": self.num_masked_rows,
            "grammar_mask_seconds": self.mask_seconds,
            "grammar_fill_seconds": self.fill_seconds,
        }

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
