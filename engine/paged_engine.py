"""PagedEngine: an engine around a runner -- requests, the scheduler, the paged block pool
and prefix cache, the KV handoff operations (reserve, admit, release), stepping and stats.
Torch-free: what computes a step is the runner it is given.

- LLMEngine (engine/llm_engine.py) gives it the model, the KV tensors and a ModelRunner;
- SimulatedEngine (engine/simulated/simulated_engine.py) gives it a runner that waits as long
  as a step-time profile says the forward would take and emits deterministic tokens.

Both implement EngineProtocol (engine/engine_protocol.py), the API the workers use.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Protocol

from splitserve.engine.config import EngineConfig, async_scheduling_pays
from splitserve.engine.core.block_hash import root_hash
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.scheduler import ScheduledBatch, Scheduler
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.engine_errors import EngineStepError
from splitserve.engine.engine_protocol import EngineProtocol, LayerHookFactory
from splitserve.engine.io.output_processor import OutputProcessor
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.request_validation import validate_prompt
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.kv_handoff import KVHandoff
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.step_pipeline import Deliver, StepPipeline
from splitserve.engine.step_timing import StepTiming
from splitserve.engine.structured_output.grammar_compiler import GrammarCompiler
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.kv_events import KVEvent
from splitserve.proto.messages.sampling_params import SamplingParams

if TYPE_CHECKING:  # the speculator may load a draft model (torch): the real engine builds it
    from splitserve.engine.speculative.speculator import Speculator


class StepRunner(Protocol):
    """What computes a scheduled batch: ModelRunner, or the simulated engine's runner."""

    def execute(self, batch: ScheduledBatch, on_layer_done: Callable[[int], None] | None = None) -> dict: ...

    # execute split in two for async scheduling (engine/step_pipeline.py): prepare reads the
    # sequences on the loop thread, run computes on the forward thread while they move on.
    # previous: the result of the step still running when this one was scheduled (its
    # placeholder rows' tokens); before_sampling waits until the scheduler holds those tokens.
    def prepare(self, batch: ScheduledBatch) -> Any: ...

    def run(
        self,
        prepared: Any,
        on_layer_done: Callable[[int], None] | None = None,
        previous: dict | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> dict: ...

    def forget(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...


class PagedEngine(KVHandoff, EngineProtocol):
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        kv_cache: Any,
        runner: StepRunner,
        speculator: Speculator | None = None,
        *,
        kv_block_bytes: int = 0,
        num_host_blocks: int = 0,
        make_host_mover: Callable[[int], Any] | None = None,
    ):
        """kv_block_bytes: one block's bytes over all layers (for stats). num_host_blocks: the
        host KV tier's size (kv_offloading_size; 0 = off); make_host_mover(num_host_blocks)
        builds what copies blocks between the tiers (the real engine's HostKVCache)."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = min(config.max_model_len or model_config.max_context_len, model_config.max_context_len)
        self.kv_cache = kv_cache
        self.kv_block_bytes = kv_block_bytes
        # Every layer windowed: blocks behind every window are freed. Not with a draft model:
        # it reads the same block tables, and prefills the prompt positions it has not seen.
        window = model_config.kv_window if speculator is None or speculator.draft_proposer is None else None
        self.kv = KVCacheManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching, num_host_blocks, window
        )
        # The host KV tier: evicted blocks kept in host memory, read back on a hit.
        self.host_kv_cache = None
        if self.kv.host is not None:
            if make_host_mover is None:
                raise ValueError("a host KV tier needs a block mover (this engine cannot offload)")
            self.host_kv_cache = make_host_mover(num_host_blocks)
            self.kv.set_mover(self.host_kv_cache)
        self.eos_token_ids = tokenizer.eos_token_ids or model_config.eos_token_ids
        # In-process: every grammar here passed the ingress's static bounds and its isolated
        # compile check; the compiler re-checks the bounds before llguidance sees it anyway.
        self.grammar = GrammarCompiler(
            tokenizer.to_json(), model_config.vocab_size, self.eos_token_ids, config=config.grammar
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            self.eos_token_ids,
            max_loras=config.max_loras if config.enable_lora else None,
            mixed_step_prefill_tokens=config.mixed_step_prefill_tokens,
        )
        self.runner = runner
        self.outputs = OutputProcessor(tokenizer)
        # Speculative decoding (engine/speculative): drafts verified inside the continuous batch.
        self.speculator = speculator
        self._ids = itertools.count()
        self._reserved: dict[str, Sequence] = {}  # request id -> sequence holding reserved blocks
        self._early: set[str] = set()  # reserved requests whose first token went out early (KVHandoff)
        self.num_steps = 0
        self.timing = StepTiming()
        # Async scheduling: the next step scheduled while one runs (engine/step_pipeline.py).
        if config.async_scheduling is None:  # unset: on where the decode step is scripted
            scripted = getattr(runner, "scripted_decode", None) is not None and config.kv_cache_dtype == "auto"
            config.async_scheduling = async_scheduling_pays(scripted)
        self.pipeline = StepPipeline(self) if config.async_scheduling and speculator is None else None

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
        self._check_lora_adapter(params.lora_adapter)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seq = Sequence(
            rid,
            prompt_token_ids,
            params,
            self.config.block_size,
            prefill_only=prefill_only,
            root_hash=root_hash(self.config.hash_seed, params.lora_adapter),
        )
        if params.structured_output is not None:
            # Compiles on a cache miss: callers on an event loop run this in a worker thread.
            seq.grammar = self.grammar.new_matcher(params.structured_output)
            resumed = params.num_resumed_tokens
            # A migrated request's matcher goes over the output it resumes before it samples.
            if resumed and seq.grammar.accept_tokens(prompt_token_ids[-resumed:]) != resumed:
                raise InvalidRequestError("the continuation's resumed output does not match its grammar")
        return seq

    def _check_lora_adapter(self, name: str | None) -> None:
        if name is None or name in (self.config.lora_modules or {}):
            return
        if not self.config.enable_lora:
            raise InvalidRequestError(f"LoRA adapter {name!r} requested but this engine serves no adapters")
        served = ", ".join(sorted(self.config.lora_modules or {})) or "none"
        raise InvalidRequestError(f"unknown LoRA adapter {name!r} (served: {served})")

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
        if self.pipeline is not None:
            self.pipeline.drop_dead()  # a step in flight for aborted requests only: waited for

    def _forget(self, request_id: str) -> None:
        """Drop the per-request state the runner and the speculator keep."""
        self.runner.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def abort_all(self) -> list[str]:
        """Abort every request and reservation (the engine is being given up): every block
        goes back to the pool. Returns the ids aborted."""
        if self.pipeline is not None:
            self.pipeline.clear()  # the forward in flight is waited for; its requests are aborted now
        request_ids = list(dict.fromkeys([*self.scheduler.requests, *self._reserved]))
        for request_id in request_ids:
            self.abort(request_id)
        return request_ids

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self.pipeline is not None and self.pipeline.busy)

    # ---- stepping ------------------------------------------------------------------------
    def step(self, layer_hook: LayerHookFactory | None = None, deliver: Deliver | None = None) -> list[RequestOutput]:
        """Schedule a batch, run it, post-process it. If anything in between raises, every
        request of the batch is failed (see _fail_batch) and EngineStepError is raised; the
        engine stays consistent and the next step serves the others. With deliver, outputs
        are handed to it (and [] returned). With async scheduling (StepPipeline) they are the
        outputs of the step submitted before, built (and delivered) while the next one runs."""
        if self.pipeline is not None:
            return self.pipeline.step(layer_hook, deliver)
        entered = self.timing.step_entered()
        try:
            outputs = self._step_sync(layer_hook)
        finally:
            self.timing.step_exited(entered, self.has_unfinished())
        if deliver is None:
            return outputs
        deliver(outputs)
        return []

    def _step_sync(self, layer_hook: LayerHookFactory | None) -> list[RequestOutput]:
        speculator = self.speculator
        batch = self.scheduler.schedule(speculator.lookahead(self.scheduler.running) if speculator else None)
        if batch.is_empty:
            return []
        try:
            start = time.perf_counter()  # the step's cost includes drafting (a draft model's passes)
            if speculator is not None:
                speculator.fill(batch)
            on_layer_done = layer_hook(batch) if layer_hook is not None else None
            forward_start = time.perf_counter()
            sampled = self.runner.execute(batch, on_layer_done)
            end = time.perf_counter()
            self.timing.forward(
                forward_start, end, 0.0, batch.num_tokens, batch.num_prefill_tokens, batch.is_fresh_prompt
            )
            self.timing.waited(end - forward_start)
            advanced = self.scheduler.update(batch, sampled)
            if speculator is not None:
                speculator.record(batch, sampled, end - start)
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
        while len(final) < len(seqs):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[s.request_id] for s in seqs]

    # ---- prefix cache and load, for the router -------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """KV events since the last call, in order."""
        return self.kv.take_events()

    def snapshot(self) -> tuple[int, list[int]] | tuple[int, list[int], list[int]]:
        """(sequence number of the last KV event, every cached block hash) for a full resync;
        with a host tier, the hashes it holds come third."""
        return self.kv.snapshot()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.config.num_kv_blocks,
            kv_block_bytes=self.kv_block_bytes,
            kv_cache_dtype=self.config.kv_cache_dtype,
            kv_usage=self.kv.usage,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_waiting_tokens=self.scheduler.num_waiting_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            preemptions_by_priority=dict(self.scheduler.preemptions_by_priority),
            num_computed_prompt_tokens=self.scheduler.num_computed_prompt_tokens,
            num_prefix_hit_tokens=self.kv.num_hit_tokens,
            **self._host_tier_stats(),
            **self.grammar.stats(),
            **self.runner.stats(),
            **self.timing.stats(),
            async_scheduling=self.pipeline is not None,
            **(self.speculator.stats() if self.speculator is not None else {}),
        )

    def _host_tier_stats(self) -> dict[str, Any]:
        host, mover = self.kv.host, self.host_kv_cache
        if host is None or mover is None:
            return {}
        return {
            "host_num_blocks": host.num_blocks,
            "host_num_used_blocks": host.num_used_blocks,
            "host_stored_blocks": host.num_stored_blocks,
            "host_loaded_blocks": host.num_loaded_blocks,
            "host_evicted_blocks": host.num_evicted_blocks,
            "host_hit_tokens": self.kv.num_host_hit_tokens,
            "host_loads": mover.num_loads,
            "host_load_seconds": mover.load_seconds,
            "host_save_seconds": mover.save_seconds,
        }

    @property
    def device(self) -> Any:
        return self.kv_cache.device
