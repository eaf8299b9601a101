"""Prompt log-probabilities (completions `echo` with `logprobs`, as lm-evaluation-harness
scores a continuation): every prompt token's log-probability given the tokens before it, and
the most likely alternatives at each position, read from the prompt's own logits.

Position p's logits score prompt token p + 1, so a prompt of P tokens has P - 1 entries (the
first token has nothing before it); the last prompt position's logits are the first output
token's, which the sampler reads. They are recorded as each prefill chunk computes, so a
chunked prompt is covered chunk by chunk. Values are of the raw logits (no penalties, bias or
grammar), like every log-probability splitserve reports.
"""

from __future__ import annotations

import torch

from splitserve.engine.core.sequence import Sequence

# Rows whose full-vocabulary logits exist at once: bounds the memory a long chunk takes
# (rows x vocabulary floats), whatever the token budget.
ROWS_PER_SLICE = 256

# (sequence, flat row of its first position to score, that position, how many positions)
PromptRows = tuple[Sequence, int, int, int]


class PromptLogprobs:
    """Scores the prompt positions a batch computes for the sequences that ask for them."""

    def __init__(self, compute_logits):
        self.compute_logits = compute_logits  # hidden [N, H] -> float32 logits [N, vocab]

    @staticmethod
    def plan(seqs: list[Sequence], num_new_tokens: list[int], last_index: list[int]) -> list[PromptRows]:
        """The rows to score this step: each sequence still lacking prompt log-probabilities
        scores the prompt positions its chunk computes, except positions it already has (it
        recomputes them after a preemption) and the last prompt position."""
        plans = []
        for seq, n, last in zip(seqs, num_new_tokens, last_index):
            if not seq.needs_prompt_logprobs:
                continue
            start = seq.num_computed_tokens
            # With async scheduling the chunk before may still be running: record() checks
            # for gaps, in forward order.
            low = max(start, len(seq.prompt_logprobs))
            high = min(start + n, seq.num_prompt_tokens - 1)
            if low < high:
                plans.append((seq, last - n + 1 + low - start, low, high - low))
        return plans

    def record(self, hidden: torch.Tensor, plans: list[PromptRows]) -> None:
        """Score the planned rows of hidden [tokens, H] and append the results to their sequences."""
        for seq, first_row, position, num_rows in plans:
            have = len(seq.prompt_logprobs)
            if have < position:  # a gap: such requests never read cached blocks
                raise RuntimeError(f"{seq.request_id}: prompt position {position} computed before {have}")
            if have > position:  # recorded since the plan (a recompute after a preemption)
                skip = min(have - position, num_rows)
                first_row, position, num_rows = first_row + skip, position + skip, num_rows - skip
            k = seq.params.prompt_logprobs
            for offset in range(0, num_rows, ROWS_PER_SLICE):
                count = min(ROWS_PER_SLICE, num_rows - offset)
                rows = hidden[first_row + offset : first_row + offset + count]
                logprobs = torch.log_softmax(self.compute_logits(rows), dim=-1)
                first = position + offset + 1  # the prompt token the first row scores
                targets = torch.tensor(seq.prompt_token_ids[first : first + count], device=logprobs.device)
                chosen = logprobs.gather(1, targets.unsqueeze(1))
                # Rank as vLLM's: 1 + how many tokens are more likely than the prompt's.
                ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
                tops = []
                if k:
                    values, indices = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=-1)
                    tops = [list(zip(ids, lps)) for ids, lps in zip(indices.tolist(), values.tolist())]
                seq.add_prompt_logprobs(chosen.squeeze(1).tolist(), tops, ranks)
