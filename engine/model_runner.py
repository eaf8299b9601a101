"""Turns a scheduled batch into tensors, runs the model and samples. The only place the
colocated engine and the workers touch tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from splitserve.engine.core.scheduler import ScheduledBatch
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.lora.lora_batch import LoraBatch
from splitserve.engine.lora.lora_slots import LoraSlots
from splitserve.engine.model.scripted_decode import decode_plan_applies
from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.sample.prompt_logprobs import PromptLogprobs, PromptRows
from splitserve.engine.sample.sampler import SampledToken, Sampler
from splitserve.engine.speculative.rejection_sampler import RejectionSampler
from splitserve.engine.step_threads import StepThreads
from splitserve.engine.structured_output.grammar_mask import GrammarMask


class PreparedStep(NamedTuple):
    """What prepare() builds for run(): the step's tensors and which rows sample."""

    batch: ScheduledBatch
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: list[int]  # hidden-state rows whose logits are computed
    seqs: list[Sequence]  # the sequences those rows sample for, in order
    seq_drafts: list[list[int]]
    prompt_rows: list[PromptRows]
    # Async scheduling: (input row, request id) of decode rows whose input token the step in
    # flight is still sampling; run() fills them in from that step's tokens.
    placeholders: list[tuple[int, str]]
    # A CPU decode step whose every row samples greedily with nothing changing its logits: the
    # placeholder fill, forward and argmax run as one TorchScript call without the GIL
    # (engine/model/scripted_decode.py). Then the placeholder rows as a tensor, built here.
    greedy_fill_rows: torch.Tensor | None = None
    # Each sequence's LoRA adapter (engine/lora/; None: the base); None when no sequence has
    # one. run() brings them into the device's slots: with async scheduling the step before
    # this one may still be running on the adapters the slots hold while this one is prepared.
    lora_adapters: list[str | None] | None = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        seed: int = 0,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        lora: LoraSlots | None = None,
        step_threads: StepThreads | None = None,
    ):
        """lora: the device's adapter slots, where the engine serves LoRA adapters; step_threads:
        the torch threads of each step's forward by its size (None: torch's setting, untouched)."""
        self.model = model
        self.step_threads = step_threads
        self.lora = lora
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = kv_cache.device
        self.sampler = Sampler(seed, eos_token_ids)
        self.grammar_mask = GrammarMask(model.config.vocab_size)
        self.verifier = RejectionSampler(self.sampler)
        self.prompt_logprobs = PromptLogprobs(model.compute_logits)
        # The model takes the rows run() computes logits of with the forward (tensor-parallel).
        self.announces_logits_rows = getattr(model, "takes_logits_rows", False)
        # LlamaForCausalLM.forward's output_rows (a tensor-parallel driver's model has none).
        self.selects_output_rows = bool(getattr(model, "selects_output_rows", False))

    @property
    def scripted_decode(self):
        """The model's scripted CPU decode (engine/model/scripted_decode.py), where it has one."""
        return getattr(self.model, "_scripted_decode", None)

    def build_metadata(
        self, seqs: list[Sequence], num_new_tokens: list[int], drafts: dict[str, list[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """input ids, positions, attention metadata, and the flat index of each sequence's
        last new token (where logits are read). A sequence with a draft (speculative decoding)
        computes its last real token and then the draft tokens, at the positions after it."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        tables: list[list[int]] = []
        num_tokens = 0
        for seq, n in zip(seqs, num_new_tokens):
            start = seq.num_computed_tokens
            table = seq.block_table
            draft = drafts.get(seq.request_id) if drafts else None
            if n == 1:  # a decode step: skip the slicing and ranges of the general case
                # Past the known tokens: a placeholder (async scheduling), filled in by run().
                input_ids.append(seq.token_ids[start] if start < len(seq.token_ids) else 0)
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            elif draft:
                end = start + n
                input_ids.append(seq.token_ids[start])
                input_ids.extend(draft)
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            else:
                end = start + n
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            num_tokens += n
            query_start.append(num_tokens)
            context_lens.append(start + n)
            tables.append(table)
        last_index = [q - 1 for q in query_start[1:]]
        max_blocks = -(-max(context_lens) // bs)
        # Each row: the first max_blocks entries of the sequence's table, zero-padded.
        tables = [t[:max_blocks] if len(t) >= max_blocks else t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata.build(slots, query_start, context_lens, tables, max(num_new_tokens), dev)
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            last_index,
        )

    @torch.inference_mode()
    def prepare(self, batch: ScheduledBatch) -> PreparedStep | None:
        """A step's tensors and row plan, built from the sequences (the engine loop's thread:
        with async scheduling they change while the previous step's forward runs)."""
        if batch.is_empty:
            return None
        drafts = batch.draft_token_ids
        input_ids, positions, meta, last_index = self.build_metadata(batch.seqs, batch.num_new_tokens, drafts)
        rows, seqs, seq_drafts = [], [], []
        for seq, n, num_draft, idx in zip(batch.seqs, batch.num_new_tokens, batch.num_draft_tokens, last_index):
            if seq.num_computed_tokens + n - num_draft == seq.num_tokens_with_placeholders:
                rows.extend(range(idx - num_draft, idx + 1))  # a verifying sequence: k + 1 rows
                seqs.append(seq)
                seq_drafts.append(drafts.get(seq.request_id, []))
        placeholders = [
            (idx, seq.request_id)
            for seq, idx in zip(batch.seqs, last_index)
            if seq.num_computed_tokens >= seq.num_tokens
        ]
        # Prompt chunks of requests asking for prompt log-probabilities: every position, not
        # only the last. Recorded on the sequence after the forward (a chunk samples no token).
        prompt_rows = PromptLogprobs.plan(batch.seqs, batch.num_new_tokens, last_index)
        lora = None
        if self.lora is not None and any(seq.params.lora_adapter is not None for seq in batch.seqs):
            lora = [seq.params.lora_adapter for seq in batch.seqs]
        greedy_fill_rows = None
        # The scripted decode computes no LoRA delta: a step with adapter tokens takes the
        # eager forward (measured on neither; the simplest correct choice).
        if lora is None and self._scripted_greedy_step_applies(meta, seqs, drafts, prompt_rows):
            greedy_fill_rows = torch.tensor([row for row, _ in placeholders], dtype=torch.int64, device=self.device)
        return PreparedStep(
            batch, input_ids, positions, meta, rows, seqs, seq_drafts, prompt_rows, placeholders, greedy_fill_rows, lora
        )

    def _scripted_greedy_step_applies(self, meta, seqs: list[Sequence], drafts, prompt_rows) -> bool:
        if self.scripted_decode is None or drafts or prompt_rows or len(seqs) != meta.num_seqs:
            return False
        if not decode_plan_applies(meta, self.kv_cache):
            return False
        return all(
            s.grammar is None and s.params.is_greedy and not s.params.logprobs and not s.params.processes_logits
            for s in seqs
        )

    @torch.inference_mode()
    def run(
        self,
        step: PreparedStep | None,
        on_layer_done: Callable[[int], None] | None = None,
        previous: dict[str, SampledToken | list[SampledToken]] | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> dict[str, SampledToken | list[SampledToken]]:
        """Run a prepared step (the forward thread, with async scheduling); returns the sampled
        token for each sequence that reached its end. In a batch with drafts every such sequence
        gets the list of tokens it emits instead: its accepted draft tokens and one more
        (spec/rejection_sampler.py).

        Async scheduling, a step scheduled while the one before it ran: previous is that
        step's result (None if it failed), whose tokens become the placeholder rows' inputs;
        before_sampling returns once the scheduler holds those tokens, so masks, penalties and
        seeds see every token the synchronous step's sampling sees."""
        if step is None:
            return {}
        if self.step_threads is not None:
            self.step_threads.enter(step.batch.num_tokens)
        batch, rows, seqs, seq_drafts = step.batch, step.rows, step.seqs, step.seq_drafts
        if step.greedy_fill_rows is not None and on_layer_done is None:  # the call has no per-layer hook
            return self._run_scripted_greedy(step, previous or {}, before_sampling)
        drafts = batch.draft_token_ids
        if step.placeholders:
            self._fill_placeholders(step, previous or {})
        if before_sampling is None:
            # Constrained rows' masks are computed during the forward (each draft row its own).
            self.grammar_mask.start(seqs, seq_drafts if drafts else None)
        # Only a LoRA step passes lora: a tensor-parallel model (LoRA refused there) takes none.
        extra: dict = {} if step.lora_adapters is None else {"lora": self._lora_batch(step)}
        if rows and not step.prompt_rows and self.announces_logits_rows:
            # A tensor-parallel model's other ranks then compute their logits with the forward
            # (engine/parallel/tp_model.py); prompt log-probabilities would take logits first.
            extra["logits_rows"] = rows
        # A prefill reads out few rows: the last layer computes only those (LlamaForCausalLM.forward).
        read_out = self._reads_out_rows(step)
        if read_out:
            extra["output_rows"] = rows
        hidden = self.model(
            step.input_ids, step.positions, self.kv_cache, step.meta, on_layer_done=on_layer_done, **extra
        )
        if step.prompt_rows:
            self.prompt_logprobs.record(hidden, step.prompt_rows)
        if not rows:
            return {}
        if before_sampling is not None:  # the grammars hold the last step's tokens from here
            before_sampling()
            self.grammar_mask.start(seqs)
        if read_out or len(rows) == hidden.shape[0]:
            selected = hidden
        else:
            selected = hidden.index_select(0, torch.tensor(rows, device=hidden.device))
        logits = self.grammar_mask.apply(self.model.compute_logits(selected))
        if drafts:
            probs = batch.draft_probs
            groups = [(s, d, probs.get(s.request_id)) for s, d in zip(seqs, seq_drafts)]
            emitted = self.verifier.verify(logits, groups)
            return {s.request_id: tokens for s, tokens in zip(seqs, emitted)}
        # Prefill-only sequences (disaggregated prefill) take this same path: the first token
        # gets the request's grammar mask, penalties, logit_bias and min_tokens like every later one.
        # The scheduler advances each grammar by the tokens its request emits.
        results = self.sampler.sample(logits, seqs)
        return {s.request_id: r for s, r in zip(seqs, results)}

    def _reads_out_rows(self, step: PreparedStep) -> bool:
        """Whether the forward returns only the sampled rows: where the model takes output_rows,
        the step has rows it does not sample, and nothing reads every row (prompt
        log-probabilities) or adds per-token deltas (LoRA)."""
        return (
            self.selects_output_rows
            and len(step.rows) < step.input_ids.shape[0]
            and not step.prompt_rows
            and step.lora_adapters is None
        )

    def _run_scripted_greedy(
        self, step: PreparedStep, previous: dict, before_sampling: Callable[[], None] | None
    ) -> dict[str, SampledToken | list[SampledToken]]:
        """run() as one scripted call: what the forward thread does with the GIL is building
        the fill tokens and reading the argmax back. Nothing it samples depends on the
        scheduler's state, so it need not wait for before_sampling to compute; it still waits
        (the step timing's stall) before returning, as every sampled step does."""
        fill_ids = torch.tensor(self._placeholder_tokens(step, previous), dtype=torch.int64, device=self.device)
        tokens = self.scripted_decode.greedy_step(
            step.input_ids, step.positions, self.kv_cache, step.meta, step.greedy_fill_rows, fill_ids
        ).tolist()
        if before_sampling is not None:
            before_sampling()
        return {s.request_id: (token, None, None) for s, token in zip(step.seqs, tokens)}

    @staticmethod
    def _placeholder_tokens(step: PreparedStep, previous: dict[str, SampledToken | list[SampledToken]]) -> list[int]:
        """The placeholder rows' inputs: the tokens the step before sampled. A request missing
        there (its step failed) gets token 0: it was failed too, and its row is discarded."""
        tokens = [previous.get(request_id, (0,)) for _, request_id in step.placeholders]
        return [token[0] if isinstance(token, tuple) else 0 for token in tokens]

    @classmethod
    def _fill_placeholders(cls, step: PreparedStep, previous: dict[str, SampledToken | list[SampledToken]]) -> None:
        rows = torch.tensor([row for row, _ in step.placeholders], device=step.input_ids.device)
        ids = torch.tensor(cls._placeholder_tokens(step, previous), dtype=step.input_ids.dtype, device=rows.device)
        step.input_ids.index_copy_(0, rows, ids)

    def _lora_batch(self, step: PreparedStep) -> LoraBatch:
        """The step's adapters made resident in the device's slots (on the thread that runs the
        forwards, in order: no step in flight reads a slot replaced here), and its LoraBatch."""
        assert self.lora is not None and step.lora_adapters is not None
        names = {name for name in step.lora_adapters if name is not None}
        self.lora.acquire(names, keep=step.batch.running_adapters)
        batch = LoraBatch.for_sequences(self.lora, step.lora_adapters, step.batch.num_new_tokens)
        assert batch is not None
        return batch

    def execute(
        self, batch: ScheduledBatch, on_layer_done: Callable[[int], None] | None = None
    ) -> dict[str, SampledToken | list[SampledToken]]:
        """prepare + run, one step on the calling thread (the synchronous step)."""
        return self.run(self.prepare(batch), on_layer_done)

    def forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)

    def stats(self) -> dict:
        """Structured-output masking figures (EngineStats' grammar_mask_* fields), and where
        adapters are served the LoRA slots (lora_slots, lora_slots_used), the adapters resident
        on the device and in the host cache, and loads and evictions by tier."""
        if self.lora is None:
            return self.grammar_mask.stats()
        slots = self.lora
        return {
            **self.grammar_mask.stats(),
            "lora_slots": slots.max_loras,
            "lora_slots_used": len(slots.slot_of),
            **slots.residency(),
            **slots.stats.stats(),
        }
