"""Per-request changes to the logits before a token is chosen, applied to the whole batch with
tensor ops (no Python loop over the vocabulary or per request in the math): min_tokens,
logit_bias, and vLLM's repetition / frequency / presence penalties, in vLLM's order.

Only the rows whose request asks for one of them are touched, and within a row only the
tokens concerned, so an ordinary batch pays one `any()` over its parameters and nothing else.
"""

from __future__ import annotations

from itertools import chain

import torch

from splitserve.engine.core.sequence import Sequence


def flat_keys(token_lists: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """row * vocab_size + token for every token of every row (row i = token_lists[i])."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), dtype=torch.int64), lengths)
    return (rows * vocab_size + tokens).to(device)


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties, in place on contiguous [R, V] logits; presence/frequency/repetition
    are [R]. Returns logits.

    repetition (prompt and output tokens): a seen token's positive logit is divided by it,
    a negative one multiplied, so > 1 always makes it less likely. frequency subtracts
    penalty x its count in the output, presence subtracts penalty once if it occurs there.
    Only the (row, token) pairs that occur are touched: the work grows with the tokens seen,
    not with batch x vocabulary.
    """
    vocab_size = logits.shape[1]
    flat = logits.view(-1)
    out_keys, out_counts = torch.unique(flat_keys(output_ids, vocab_size, logits.device), return_counts=True)
    seen = torch.unique(torch.cat([flat_keys(prompt_ids, vocab_size, logits.device), out_keys]))
    if seen.numel():
        # Clamped into the dtype's normal range: a penalty that underflows to 0 (5e-324 in
        # float32) would turn a masked -inf logit into NaN, which argmax would then pick.
        finfo = torch.finfo(logits.dtype)
        scale = repetition.clamp(finfo.tiny, finfo.max)[seen // vocab_size]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / scale, values * scale)
    if out_keys.numel():
        rows = out_keys // vocab_size
        flat[out_keys] -= frequency[rows] * out_counts.to(logits.dtype) + presence[rows]
    return logits


class LogitsProcessing:
    """Applies each request's min_tokens, logit_bias and penalties to a batch's logits."""

    def __init__(self, eos_token_ids: list[int] | tuple[int, ...] = ()):
        self.eos_token_ids = tuple(eos_token_ids)

    def stop_token_ids(self, seq: Sequence) -> list[int]:
        """What would end seq now: its stop tokens and, unless it ignores EOS, the EOS tokens."""
        ids = list(seq.params.stop_token_ids)
        return ids if seq.params.ignore_eos else ids + list(self.eos_token_ids)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [N, V] float32 for seqs[i] in row i; returns the processed logits (the same
        tensor, changed in place, when it is contiguous)."""
        rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
        if not rows:
            return logits
        every_row = len(rows) == len(seqs)
        chosen = seqs if every_row else [seqs[i] for i in rows]
        index = None if every_row else torch.tensor(rows, dtype=torch.int64, device=logits.device)
        sub = logits.contiguous() if every_row else logits.index_select(0, index)
        sub = self._mask_stops_before_min_tokens(sub, chosen)
        sub = self._add_logit_bias(sub, chosen)
        if any(s.params.has_penalties for s in chosen):
            sub = self._penalize(sub, chosen)
        return sub if every_row else logits.index_copy_(0, index, sub)

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
        device = sub.device
        # The prompt only matters to the repetition penalty; skip it where that is off. A
        # migrated request's continuation ends its prompt with output: counted as output here.
        splits = [len(s.prompt_token_ids) - s.params.num_resumed_tokens for s in seqs]
        prompts = [s.prompt_token_ids[:n] if s.params.repetition_penalty != 1 else [] for s, n in zip(seqs, splits)]
        outputs = [
            s.prompt_token_ids[n:] + s.output_token_ids if n < len(s.prompt_token_ids) else s.output_token_ids
            for s, n in zip(seqs, splits)
        ]

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(s.params, name) for s in seqs], dtype=sub.dtype, device=device)

        return apply_penalties(
            sub,
            prompts,
            outputs,
            column("presence_penalty"),
            column("frequency_penalty"),
            column("repetition_penalty"),
        )
