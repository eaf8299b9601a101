"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from splitserve.engine.io.sampling_params import SamplingParams


class Sampler:
    def __init__(self, seed: int = 0):
        self._default_generator = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default_generator
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        return gen

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[tuple[int, float | None]]:
        """logits [N, vocab] float32 -> (token id, logprob of that token or None) per row."""
        logits = logits.float()
        # max(dim).indices is argmax (the first maximum on ties, NaN counts as the maximum),
        # about 1.5x faster on CPU.
        greedy = logits.max(dim=-1).indices.tolist()
        want_logprobs = any(p.logprobs for p in params)
        if not want_logprobs and all(p.is_greedy for p in params):
            return [(token, None) for token in greedy]  # the common all-greedy batch
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        results: list[tuple[int, float | None]] = []
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            token = greedy[row] if p.is_greedy else self._sample_row(logits[row], p, self.generator_for(rid, p))
            lp = float(logprobs[row, token]) if (logprobs is not None and p.logprobs) else None
            results.append((token, lp))
        return results

    @staticmethod
    def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        row = row / p.temperature
        if p.top_k and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            return int(torch.argmax(row))  # degenerate logits: never let one request crash the batch
        if p.top_p < 1.0:
            sorted_probs, sorted_idx = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest set whose mass reaches top_p (always at least one token).
            drop = cumulative - sorted_probs > p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=gen)
            return int(sorted_idx[choice])
        return int(torch.multinomial(probs, 1, generator=gen))
