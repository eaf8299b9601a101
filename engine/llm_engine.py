"""The colocated engine: prefill and decode in one process. The offline API and the baseline
the disaggregated system is compared with; the workers reuse its parts.

The prefill and decode workers use only its named operations (make_sequence with prefill_only,
reserve_prompt_blocks, admit_prefilled, release_*, abort, prompt_block_ids, take_events,
snapshot, stats, kv_cache, device), through EngineLoop; tests/workers/test_engine_api_use.py
checks that by parsing their source.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.kv_events import KVEvent
from splitserve.engine.core.scheduler import ScheduledBatch, Scheduler
from splitserve.engine.core.sequence import Sequence, SequenceStatus
from splitserve.engine.engine_errors import EngineStepError
from splitserve.engine.io.block_reservation import BlockReservation
from splitserve.engine.io.engine_stats import EngineStats
from splitserve.engine.io.output_processor import OutputProcessor
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.request_validation import validate_prompt
from splitserve.engine.io.sampling_params import InvalidRequestError, SamplingParams
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.model.loader import load_model
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.sample.grammar_compiler import GrammarCompiler
from splitserve.engine.spec.speculator import Speculator

# Given the batch about to run, returns a per-layer callback (or None) for that step. The
# prefill worker uses it to send each layer's KV while the next layer computes.
LayerHookFactory = Callable[[ScheduledBatch], Callable[[int], None] | None]


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model, self.model_config = load_model(config.model, dtype=config.dtype, device=config.device)
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_context_len, self.model_config.max_context_len
        )
        self.kv_cache = KVCache(self.model_config, config)
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        eos = self.tokenizer.eos_token_ids or self.model_config.eos_token_ids
        self.grammar = GrammarCompiler(self.tokenizer.to_json(), self.model_config.vocab_size, eos)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, eos)
        self.runner = ModelRunner(self.model, self.kv_cache, config.seed, eos)
        self.outputs = OutputProcessor(self.tokenizer)
        # Speculative decoding (engine/spec): drafts verified inside the continuous batch.
        self.speculator = Speculator.for_engine(config, self.model_config.vocab_size)
        self._ids = itertools.count()
        self._reserved: dict[str, Sequence] = {}  # request id -> sequence holding reserved blocks
        self.num_steps = 0

    @classmethod
    def from_model_dir(cls, model: str, **kwargs) -> LLMEngine:
        return cls(EngineConfig(model=model, **kwargs))

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str) or not prompt:
            raise InvalidRequestError("the prompt is empty")
        return self.tokenizer.encode(prompt)

    def make_sequence(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams | None,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> Sequence:
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None:
                raise InvalidRequestError("give a prompt or prompt_token_ids")
            prompt_token_ids = self.tokenize(prompt)
        validate_prompt(
            prompt_token_ids,
            params,
            self.model_config.vocab_size,
            self.max_model_len,
            self.config.num_kv_blocks * self.config.block_size,
        )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(rid, prompt_token_ids, params, self.config.block_size, prefill_only=prefill_only)
        if params.structured_output is not None:
            # Compiles on a cache miss: callers on an event loop run this in a worker thread.
            seq.grammar = self.grammar.new_matcher(params.structured_output)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence from make_sequence. A prefill_only one stops after its first token
        and keeps its blocks (pinned) until release_prefilled."""
        self.scheduler.add(seq)

    def add_request(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        seq = self.make_sequence(prompt, prompt_token_ids, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free all it holds (blocks, a reservation, detokenizer state).
        Unknown or finished ids are ignored."""
        self.release_reservation(request_id)
        self.scheduler.abort(request_id)
        self._forget(request_id)
        self.outputs.forget(request_id)

    def _forget(self, request_id: str) -> None:
        """Drop the per-request state the runner and the speculator keep."""
        self.runner.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def abort_all(self) -> list[str]:
        """Abort every request and reservation (the engine is being given up): every block
        goes back to the pool. Returns the ids aborted."""
        request_ids = list(dict.fromkeys([*self.scheduler.requests, *self._reserved]))
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def release_prefilled(self, request_id: str) -> None:
        """After the KV handoff: a prefilled request's blocks are unpinned (they stay in the
        prefix cache, evictable); a request that has not finished prefilling is aborted."""
        seq = self.scheduler.requests.get(request_id)
        if seq is None:
            return
        if seq.status is SequenceStatus.PREFILLED:
            self.scheduler.release_prefilled(seq)
        else:
            self.abort(request_id)

    def prompt_block_ids(self, request_id: str, block_indices: Iterable[int]) -> list[int]:
        """The local block ids of a queued or running request's prompt blocks, by index."""
        table = self.scheduler.requests[request_id].block_table
        return [table[i] for i in block_indices]

    # ---- disaggregated decode: reserve blocks, receive the KV, admit ---------------------
    def reserve_prompt_blocks(self, seq: Sequence) -> BlockReservation | None:
        """Reuse every cached full block of seq's prompt and allocate the rest, before its KV
        arrives from a prefill replica. Returns the prompt blocks still to receive and where
        they go, or None (holding nothing) if blocks are short. The blocks stay reserved until
        admit_prefilled, release_reservation or abort."""
        if seq.request_id in self._reserved:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        kv = self.kv
        cached = kv.find_cached_blocks(seq, max_tokens=seq.num_prompt_tokens)
        if not kv.allocate_prompt(seq, cached, seq.num_prompt_tokens - len(cached) * kv.block_size):
            return None
        self._reserved[seq.request_id] = seq
        pairs = sorted(((i, seq.block_table[i]) for i in range(len(cached), len(seq.block_table))), key=lambda p: p[1])
        return BlockReservation([i for i, _ in pairs], [b for _, b in pairs])

    def release_reservation(self, request_id: str) -> None:
        """Free a reservation's blocks (its transfer failed or was abandoned). Unknown ids are ignored."""
        seq = self._reserved.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def admit_prefilled(
        self,
        request_id: str,
        first_token: int,
        first_logprob: float | None,
        num_cached_tokens: int,
        first_top_logprobs: list[tuple[int, float]] | None = None,
        queue_seconds: float | None = None,
        prompt_logprobs: list[float] | None = None,
        prompt_top_logprobs: list[list[tuple[int, float]]] | None = None,
        prompt_ranks: list[int] | None = None,
    ) -> RequestOutput:
        """The reserved prompt's KV is in place: append the first token (sampled by the prefill
        replica, with its top alternatives when asked for), check the stop conditions, join the
        running batch, and return the first output, post-processed exactly like a step's.
        queue_seconds: how long the prompt waited in the prefill replica's queue.
        prompt_logprobs, prompt_top_logprobs, prompt_ranks: what the prefill replica computed
        for a request with SamplingParams.prompt_logprobs (Sequence.prompt_logprobs)."""
        seq = self._reserved[request_id]
        if seq.params.prompt_logprobs is not None:
            self._check_prompt_logprobs(seq, prompt_logprobs, prompt_top_logprobs, prompt_ranks)
        # A constrained request's grammar state crosses as the tokens the prefill replica
        # accepted (the first token): replay it into this replica's matcher.
        if seq.grammar is not None and not seq.grammar.accept_token(first_token):
            error = seq.grammar.error.strip()
            self.release_reservation(request_id)
            raise RuntimeError(
                f"the prefill replica's first token {first_token} breaks the request's grammar ({error}); "
                "is it running an older splitserve?"
            )
        if seq.params.prompt_logprobs is not None:
            seq.add_prompt_logprobs(
                [float(lp) for lp in prompt_logprobs],
                [[(int(t), float(lp)) for t, lp in top] for top in prompt_top_logprobs or ()],
                [int(rank) for rank in prompt_ranks],
            )
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.num_cached_tokens = num_cached_tokens
        seq.queue_seconds = queue_seconds
        top = [(int(t), float(lp)) for t, lp in first_top_logprobs or ()] if seq.params.top_logprobs else None
        seq.append_token(first_token, first_logprob if seq.params.logprobs else None, top)
        reason = self.scheduler.check_stop(seq)
        self.scheduler.add_prefilled(seq)  # also enters its received full blocks into the cache
        del self._reserved[request_id]  # only now: until here, abort() still frees its blocks
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._emit_output(seq)

    def _check_prompt_logprobs(self, seq: Sequence, logprobs, top_logprobs, ranks) -> None:
        """The prefill replica's prompt log-probabilities cover the prompt (and its top
        alternatives, when asked); else the reservation is freed and the request fails."""
        num = seq.num_prompt_tokens - 1
        num_top = num if seq.params.prompt_logprobs else 0
        if len(logprobs or ()) != num or len(top_logprobs or ()) != num_top or len(ranks or ()) != num:
            self.release_reservation(seq.request_id)
            raise RuntimeError(
                f"the prefill replica sent {len(logprobs or ())} prompt log-probabilities for a "
                f"{seq.num_prompt_tokens}-token prompt; is it running an older splitserve?"
            )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ------------------------------------------------------------------------
    def step(self, layer_hook: LayerHookFactory | None = None) -> list[RequestOutput]:
        """Schedule a batch, run it, post-process it. If anything in between raises, every
        request of the batch is failed (see _fail_batch) and EngineStepError is raised; the
        engine stays consistent and the next step serves the others."""
        speculator = self.speculator
        batch = self.scheduler.schedule(speculator.lookahead(self.scheduler.running) if speculator else None)
        if batch.is_empty:
            return []
        try:
            start = time.perf_counter()  # the step's cost includes drafting (a draft model's passes)
            if speculator is not None:
                speculator.fill(batch)
            on_layer_done = layer_hook(batch) if layer_hook is not None else None
            sampled = self.runner.execute(batch, on_layer_done)
            seconds = time.perf_counter() - start
            advanced = self.scheduler.update(batch, sampled)
            if speculator is not None:
                speculator.record(batch, sampled, seconds)
            outputs = [self._prefilled_output(seq) if seq.prefill_only else self._emit_output(seq) for seq in advanced]
        except Exception as exc:
            failed = self._fail_batch(batch)
            raise EngineStepError(f"engine step failed: {exc!r}", failed) from exc
        self.num_steps += 1
        return outputs

    def _fail_batch(self, batch: ScheduledBatch) -> list[str]:
        """Undo a step that raised anywhere between scheduling and its outputs. schedule() had
        moved the batch's requests to running and allocated their new slots; the forward may
        have written part of their KV; update() may have advanced some (computed counts,
        blocks entered into the prefix cache, a token appended, even finished or prefilled).
        Aborting each of them frees all of that: the blocks it wrote are new, never-hashed
        ones (a cached block is only read, and a block is hashed only after its KV is
        complete), so no half-written KV stays findable. Requests preempted while scheduling
        are back in the waiting queue, whole, and run later. Their outputs are lost, so they
        all fail, finished ones included."""
        failed = [seq.request_id for seq in batch.seqs]
        for request_id in failed:
            self.abort(request_id)
        return failed

    def _emit_output(self, seq: Sequence) -> RequestOutput:
        """seq's new tokens as an output: detokenized, cut at a stop string, and the request
        forgotten once finished. Every output but a prefill-only one comes through here."""
        out, hit_stop = self.outputs.process(seq)
        if hit_stop and not seq.is_finished:
            self.scheduler.finish(seq, "stop")
        if out.finished:
            self._forget(seq.request_id)
        return out

    def _prefilled_output(self, seq: Sequence) -> RequestOutput:
        """A prefill-only request's one output: its first token, no text (decode detokenizes)."""
        self._forget(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=[seq.token_ids[-1]],
            new_text="",
            token_ids=[seq.token_ids[-1]],
            text="",
            finished=True,
            finish_reason="prefilled",
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=list(seq.output_logprobs),
            logprobs=list(seq.output_logprobs),
            new_top_logprobs=list(seq.output_top_logprobs),
            top_logprobs=list(seq.output_top_logprobs),
            prompt_logprobs=seq.prompt_logprobs,
            prompt_top_logprobs=seq.prompt_top_logprobs,
            prompt_ranks=seq.prompt_ranks,
            queue_seconds=seq.queue_seconds,
        )

    def generate(
        self, prompts: Iterable[str | Seq[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run prompts (text or token-id lists) to completion as one batch, in order."""
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError("give one SamplingParams per prompt")
        seqs = []
        for prompt, p in zip(prompts, plist):
            if isinstance(prompt, str):
                seqs.append(self.make_sequence(prompt, None, p))
            else:
                seqs.append(self.make_sequence(None, list(prompt), p))
        for seq in seqs:  # validate all before queueing any: bad input loses nothing
            self.add_sequence(seq)
        final: dict[str, RequestOutput] = {}
        with torch.inference_mode():
            while len(final) < len(seqs):
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
        return [final[s.request_id] for s in seqs]

    # ---- prefix cache and load, for the router -------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """KV events since the last call, in order."""
        return self.kv.take_events()

    def snapshot(self) -> tuple[int, list[int]]:
        """(sequence number of the last KV event, every cached block hash) for a full resync."""
        return self.kv.snapshot()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.config.num_kv_blocks,
            kv_usage=self.kv.usage,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_waiting_tokens=self.scheduler.num_waiting_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            preemptions_by_priority=dict(self.scheduler.preemptions_by_priority),
            num_computed_prompt_tokens=self.scheduler.num_computed_prompt_tokens,
            num_prefix_hit_tokens=self.kv.num_hit_tokens,
            **self.grammar.stats(),
            **self.runner.grammar_mask.stats(),
            **(self.speculator.stats() if self.speculator is not None else {}),
        )

    @property
    def device(self) -> torch.device:
        """Where the KV cache lives (the transport opens NCCL pairs for CUDA, gloo for CPU)."""
        return self.kv_cache.device
