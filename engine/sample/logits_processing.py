"""Per-request changes to the logits before a token is chosen, applied to the whole batch with
tensor ops (no Python loop over the vocabulary or per request in the math): min_tokens,
logit_bias, and vLLM's repetition / frequency / presence penalties, in vLLM's order.

Only the rows whose request asks for one of them are touched, so an ordinary batch pays one
`any()` over its parameters and nothing else.
"""

from __future__ import annotations

from itertools import chain

import torch

from splitserve.engine.core.sequence import Sequence


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(token_lists), vocab_size] float32: how often each token occurs in each list."""
    num_rows = len(token_lists)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    if not int(lengths.sum()):
        return torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    flat = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(num_rows, dtype=torch.int64), lengths)
    counts = torch.bincount(rows * vocab_size + flat, minlength=num_rows * vocab_size)
    return counts.view(num_rows, vocab_size).to(device=device, dtype=torch.float32)


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor,
    output_counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties for [R, V] logits (a new tensor). presence/frequency/repetition are [R].

    repetition (prompt and output tokens): a seen token's positive logit is divided by it,
    a negative one multiplied, so > 1 always makes it less likely. frequency subtracts
    penalty x its count in the output, presence subtracts penalty once if it occurs there.
    """
    output_seen = output_counts > 0
    seen = output_seen | (prompt_counts > 0)
    scale = torch.where(seen, repetition.unsqueeze(1), torch.ones_like(logits))
    logits = torch.where(logits > 0, logits / scale, logits * scale)
    logits = logits - frequency.unsqueeze(1) * output_counts
    return logits - presence.unsqueeze(1) * output_seen.to(logits.dtype)


class LogitsProcessing:
    """Applies each request's min_tokens, logit_bias and penalties to a batch's logits."""

    def __init__(self, eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.eos_token_ids = tuple(eos_token_ids)

    def stop_token_ids(self, seq: Sequence) -> list[int]:
        """What would end seq now: its stop tokens and, unless it ignores EOS, the EOS tokens."""
        ids = list(seq.params.stop_token_ids)
        return ids if seq.params.ignore_eos else ids + list(self.eos_token_ids)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [N, V] float32 (modified in place and returned) for seqs[i] in row i."""
        rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
        if not rows:
            return logits
        chosen = [seqs[i] for i in rows]
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        sub = logits.index_select(0, index)
        sub = self._mask_stops_before_min_tokens(sub, chosen)
        sub = self._add_logit_bias(sub, chosen)
        if any(s.params.has_penalties for s in chosen):
            sub = self._penalize(sub, chosen)
        return logits.index_copy_(0, index, sub)

    def _mask_stops_before_min_tokens(self, sub: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        masked = [
            (row, token)
            for row, s in enumerate(seqs)
            if s.num_output_tokens < s.params.min_tokens
            for token in self.stop_token_ids(s)
        ]
        if masked:
            rows, tokens = (torch.tensor(col, dtype=torch.int64, device=sub.device) for col in zip(*masked))
            sub[rows, tokens] = float("-inf")
        return sub

    @staticmethod
    def _add_logit_bias(sub: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        entries = [(row, token, bias) for row, s in enumerate(seqs) for token, bias in s.params.logit_bias.items()]
        if entries:
            rows, tokens, biases = zip(*entries)
            device = sub.device
            sub.index_put_(
                (torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                torch.tensor(biases, dtype=sub.dtype, device=device),
                accumulate=True,
            )
        return sub

    @staticmethod
    def _penalize(sub: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab_size, device = sub.shape[1], sub.device
        output_counts = token_counts([s.output_token_ids for s in seqs], vocab_size, device)
        # The prompt only matters to the repetition penalty; skip counting it when unused.
        prompts = [s.prompt_token_ids if s.params.repetition_penalty != 1 else [] for s in seqs]
        prompt_counts = token_counts(prompts, vocab_size, device)

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(s.params, name) for s in seqs], dtype=sub.dtype, device=device)

        return apply_penalties(
            sub,
            prompt_counts,
            output_counts,
            column("presence_penalty"),
            column("frequency_penalty"),
            column("repetition_penalty"),
        )
