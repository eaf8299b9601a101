"""Verification of speculative drafts: which draft tokens a sequence keeps, and the token after them.

A sequence that proposed draft d_1..d_k is scored at k + 1 positions in one forward pass;
row j holds the target's logits for the token after the draft's first j tokens. Rows are
processed (min_tokens, logit_bias, penalties) as that position's plain step would be
(VerifyRow), then, walking j = 0, 1, ...:

- **greedy and seeded requests -- exact match.** Draw the token the plain sampler would draw
  at that position (argmax, or `Sampler.sample_row` with the request's generator reseeded from
  (seed, output position)); keep d_{j+1} while it equals that token, else emit the drawn token
  and stop. The output is token for token what the request gives without speculation, so
  per-request seeds stay reproducible whatever k the policy picks (and greedy is exact).
- **unseeded requests with temperature > 0 -- rejection sampling** (Leviathan et al. 2023;
  Chen et al. 2023): keep d_{j+1} with probability min(1, p(d)/q(d)); on rejection draw from
  norm(max(0, p - q)) and stop. p is the target's sampling distribution (temperature, top-k,
  top-p as `Sampler.sampling_probs`), q the proposer's: the draft model's distribution it
  sampled d from, or a point mass for n-gram proposals (then keep with probability p(d), and
  the residual is p without d). Each emitted token is distributed exactly as the target's.

After all k drafts are kept, one more token is drawn from row k (the bonus token).
"""

from __future__ import annotations

import torch

from splitserve.engine.core.sequence import Sequence
from splitserve.engine.sample.sampler import SampledToken, Sampler
from splitserve.engine.speculative.verify_row import VerifyRow

# (sequence, its draft tokens, the proposer's distributions [len(draft), vocab] or None for a point mass)
VerifyGroup = tuple[Sequence, list[int], torch.Tensor | None]


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def verify(self, logits: torch.Tensor, groups: list[VerifyGroup]) -> list[list[SampledToken]]:
        """logits [sum(len(draft) + 1), vocab]: each group's rows in order. Returns, per group,
        the tokens it emits: its kept draft tokens and one more."""
        views = [VerifyRow(seq, draft[:j]) for seq, draft, _ in groups for j in range(len(draft) + 1)]
        logprobs, processed = self.sampler.process(logits, views)
        greedy = processed.max(dim=-1).indices.tolist()
        results = []
        base = 0
        for seq, draft, q in groups:
            params = seq.params
            if params.is_greedy:
                tokens = self._match(draft, lambda j, b=base: greedy[b + j])
            elif params.seed is not None:
                tokens = self._match(
                    draft,
                    lambda j, b=base, p=params: self.sampler.sample_row(
                        processed[b + j], p, self.sampler.generator_for(views[b + j])
                    ),
                )
            else:
                tokens = self._rejection_sample(processed[base : base + len(draft) + 1], draft, q, views[base])
            rows = list(range(base, base + len(tokens)))
            if logprobs is None:
                results.append([(token, None, None) for token in tokens])
            else:
                chosen = self.sampler.with_logprobs(tokens, logprobs[rows], [params] * len(tokens))
                results.append(chosen)
            base += len(draft) + 1
        return results

    @staticmethod
    def _match(draft: list[int], draw) -> list[int]:
        """Exact-match verification: draw(j) is the token the plain step would emit at draft
        position j; keep draft tokens while they agree."""
        tokens = []
        for j in range(len(draft) + 1):
            token = draw(j)
            tokens.append(token)
            if j == len(draft) or token != draft[j]:
                break
        return tokens

    def _rejection_sample(
        self, rows: torch.Tensor, draft: list[int], q: torch.Tensor | None, first_view: VerifyRow
    ) -> list[int]:
        """Leviathan et al.'s algorithm over one sequence's processed rows [len(draft) + 1, vocab]."""
        params = first_view.params
        gen = self.sampler.generator_for(first_view)  # the shared default generator (unseeded)
        tokens = []
        for j, token in enumerate(draft):
            p = self.sampler.sampling_probs(rows[j], params)
            if p is None:  # degenerate logits: the plain sampler takes the argmax
                best = int(torch.argmax(rows[j]))
                tokens.append(best)
                if best != token:
                    return tokens
                continue
            q_token = 1.0 if q is None else float(q[j, token])
            p_token = float(p[token])
            # Kept with probability min(1, p / q) (u * q < p, so q == 0 needs no division).
            if p_token >= q_token or float(torch.rand((), generator=gen)) * q_token < p_token:
                tokens.append(token)
                continue
            if q is None:
                residual = p.clone()
                residual[token] = 0.0
            else:
                residual = (p - q[j].to(p.device, p.dtype)).clamp_(min=0.0)
            if float(residual.sum()) <= 0.0:  # p <= q everywhere means p == q: nothing is rejected
                residual = p
            tokens.append(self.sampler.draw(residual, gen))
            return tokens
        tokens.append(self.sampler.sample_row(rows[len(draft)], params, gen))
        return tokens
