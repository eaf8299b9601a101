"""The logits-mask step of constrained decoding, applied to a whole batch before sampling.

Per step: start() hands the batch's matchers to llguidance's executor on a helper thread
while the model runs (the next-token masks depend only on tokens already accepted, and
llguidance computes them in Rust without the GIL), apply() waits for the masks and applies
them to the constrained rows of the logits in one bitmask op, and accept() advances every
matcher by its sampled token. A batch without constrained requests costs one list scan.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from splitserve.engine.sample.token_bitmask import allocate_token_bitmask, apply_token_bitmask_, bitmask_words

logger = logging.getLogger(__name__)


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

    def start(self, seqs: list) -> None:
        """Begin computing the next-token masks of the constrained seqs (row order = seqs)."""
        self._pending = None
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        if not rows:
            return
        matchers = [seqs[i].grammar.ll_matcher for i in rows]
        if self._pool is None:
            import llguidance

            self._executor = llguidance.LLExecutor(num_threads=self.num_threads)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        if self._bitmask is None or self._bitmask.shape[0] < len(rows):
            self._bitmask = allocate_token_bitmask(max(len(rows), 8), self.vocab_size)
        self._rows = rows
        self._pending = self._pool.submit(self._fill, matchers, self._bitmask)

    def _fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        start = time.perf_counter()
        row_bytes = 4 * bitmask_words(self.vocab_size)
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            pairs = [(matcher, row) for row, matcher in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), row_bytes, bitmask.shape[0])
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

    def accept(self, seqs: list, tokens: list[int]) -> None:
        """Advance each constrained seq's matcher by the token it sampled."""
        for seq, token in zip(seqs, tokens):
            if seq.grammar is not None and not seq.grammar.accept_token(token):
                # The mask forbids such tokens; the matcher is now failed and the request
                # finishes with "abort" instead of claiming a valid output.
                logger.error("grammar rejected sampled token %d of %s: %s", token, seq.request_id, seq.grammar.error)

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
