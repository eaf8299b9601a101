"""DraftModelProposer: drafts from a smaller checkpoint with the same tokenizer, run in the
replica that verifies them (the decode replica, or the colocated engine).

Its KV cache is its own tensor but shares the target's block tables: the draft's KV for a
sequence sits in the same block ids as the target's, so it needs no allocator, no block of its
own, and rejected drafts need no rollback (their slots are simply rewritten later). How the
draft's prompt KV gets there: the draft prefills the prompt locally, the first time the
request speculates, max_prompt_chunk tokens a step (no drafts until it has caught up), so no
step stalls long on it (the `draft` preset is one layer; bench/results/draft_prompt_kv.md
measures this pass against shipping the KV). Shipping it from
the prefill replica would need a second model there and a second transfer per request, for a
prompt pass that costs the decode replica a fraction of one target step. Cached prefix blocks
are recomputed too (another request's draft KV in a shared block is the same, but blocks that
arrived from prefill hold none), and after a preemption the draft starts over.

Per step, for the scheduled sequences with reserved draft slots: one pass over each sequence's
tokens the draft has not seen yet (its backlog, ending with the last token), then one
single-token pass per further draft token, batched over the sequences. Greedy and seeded
requests take the draft's argmax (verification is an exact match); unseeded ones sample from
the draft's distribution q (the target's temperature, top-k and top-p), which rejection
sampling needs.
"""

from __future__ import annotations

import torch

from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.model.loader import load_model
from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.sample.sampler import Sampler


class DraftModelProposer:
    def __init__(
        self, draft_model: str, engine_config: EngineConfig, target_vocab_size: int, max_prompt_chunk: int = 256
    ):
        # The draft is quantized as the target is (--quantization covers both models).
        self.model, self.model_config = load_model(
            draft_model, dtype=engine_config.dtype, device=engine_config.device, quantization=engine_config.quantization
        )
        if self.model_config.vocab_size != target_vocab_size:
            raise ConfigError(
                f"draft model {draft_model} has a vocabulary of {self.model_config.vocab_size} tokens, the served "
                f"model {target_vocab_size}: the draft must use the same tokenizer"
            )
        self.kv_cache = KVCache(self.model_config, engine_config)
        self.block_size = engine_config.block_size
        self.max_prompt_chunk = max_prompt_chunk
        self.device = self.kv_cache.device
        self.generator = torch.Generator(device="cpu").manual_seed(engine_config.seed + 1)
        # request id -> (its preemption count, tokens whose draft KV is in place)
        self._computed: dict[str, tuple[int, int]] = {}
        # request id -> (its preemption count, its length, draft length) at this step's proposal
        self._pending: dict[str, tuple[int, int, int]] = {}

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """num_tokens[i] draft tokens for seqs[i] (each decoding, with that many slots reserved
        after its last token). Returns the drafts and, per sequence, the distributions its
        tokens were sampled from ([k, vocab]) or None where it took the argmax."""
        starts = [self._num_computed(seq) for seq in seqs]
        # A long backlog (a new request's prompt) is fed in chunks of max_prompt_chunk tokens,
        # one per step and without drafting, so no single step stalls on it.
        ends = [min(seq.num_tokens, start + self.max_prompt_chunk) for seq, start in zip(seqs, starts)]
        logits = self._forward(seqs, starts, [seq.token_ids[s:e] for seq, s, e in zip(seqs, starts, ends)])
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = []
        for i, (seq, end) in enumerate(zip(seqs, ends)):
            if end == seq.num_tokens:
                active.append(i)
            else:
                self._computed[seq.request_id] = (seq.num_preemptions, end)
        if len(active) != len(seqs):
            logits = logits[active]  # rows of the sequences that caught up
        while active:
            for row, i in enumerate(active):
                token, q = self._choose(logits[row], seqs[i])
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(drafts[i]) < num_tokens[i]]
            if not active:
                break
            logits = self._forward(
                [seqs[i] for i in active],
                [seqs[i].num_tokens + len(drafts[i]) - 1 for i in active],
                [[drafts[i][-1]] for i in active],
            )
        for seq, draft in zip(seqs, drafts):
            if draft:
                self._pending[seq.request_id] = (seq.num_preemptions, seq.num_tokens, len(draft))
        return drafts, [torch.stack(p) if p else None for p in probs]

    def record(self, request_id: str, num_accepted: int) -> None:
        """After verification: the draft's KV is valid for the tokens before the first rejected
        draft token (the last draft token was never fed to the draft)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            preemptions, length, num_draft = pending
            self._computed[request_id] = (preemptions, length + min(num_accepted, num_draft - 1))

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)
        self._pending.pop(request_id, None)

    def _num_computed(self, seq: Sequence) -> int:
        preemptions, computed = self._computed.get(seq.request_id, (seq.num_preemptions, 0))
        if preemptions != seq.num_preemptions:  # its blocks were freed and recomputed
            return 0
        return min(computed, seq.num_tokens - 1)

    def _choose(self, row: torch.Tensor, seq: Sequence) -> tuple[int, torch.Tensor | None]:
        params = seq.params
        if params.is_greedy or params.seed is not None:
            return int(torch.argmax(row)), None
        q = Sampler.sampling_probs(row.cpu(), params)
        if q is None:  # degenerate logits: a point mass on the argmax
            q = torch.zeros_like(row, device="cpu")
            q[int(torch.argmax(row))] = 1.0
        return int(torch.multinomial(q, 1, generator=self.generator)), q

    def _forward(self, seqs: list[Sequence], starts: list[int], chunks: list[list[int]]) -> torch.Tensor:
        """Feed chunks[i] at positions starts[i].. of seqs[i] through the draft (its KV goes
        into seqs[i]'s blocks); logits [len(seqs), vocab] at each chunk's last token."""
        bs = self.block_size
        input_ids, positions, slots, query_start, context_lens = [], [], [], [0], []
        for seq, start, chunk in zip(seqs, starts, chunks):
            end = start + len(chunk)
            table = seq.block_table
            input_ids.extend(chunk)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(query_start[-1] + len(chunk))
            context_lens.append(end)
        max_blocks = -(-max(context_lens) // bs)
        tables = [(seq.block_table + [0] * max_blocks)[:max_blocks] for seq in seqs]
        dev = self.device
        meta = AttentionMetadata.build(slots, query_start, context_lens, tables, max(len(c) for c in chunks), dev)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        hidden = self.model(ids, torch.tensor(positions, dtype=torch.int64, device=dev), self.kv_cache, meta)
        last = torch.tensor([q - 1 for q in query_start[1:]], device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, last))
