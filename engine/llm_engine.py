"""The colocated engine: prefill and decode in one process. The offline API and the baseline
the disaggregated system is compared with; the workers reuse its parts."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.scheduler import ScheduledBatch, Scheduler
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.io.output_processor import OutputProcessor
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.request_validation import validate_prompt
from splitserve.engine.io.sampling_params import InvalidRequestError, SamplingParams
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.model.loader import load_model
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.ops.kv_cache import KVCache

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
        self.kv = KVCacheManager(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        eos = self.tokenizer.eos_token_ids or self.model_config.eos_token_ids
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, eos)
        self.runner = ModelRunner(self.model, self.kv_cache, config.seed, eos)
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
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
            self.config.num_gpu_blocks * self.config.block_size,
        )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        return Sequence(rid, prompt_token_ids, params, self.config.block_size, prefill_only=prefill_only)

    def add_request(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        seq = self.make_sequence(prompt, prompt_token_ids, params, request_id)
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.runner.forget(request_id)
        self.outputs.forget(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- stepping ------------------------------------------------------------------------
    def step(self, layer_hook: LayerHookFactory | None = None) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return []
        on_layer_done = layer_hook(batch) if layer_hook is not None else None
        sampled = self.runner.execute(batch, on_layer_done)
        advanced = self.scheduler.update(batch, sampled)
        self.num_steps += 1
        results = []
        for seq in advanced:
            if seq.prefill_only:
                self.runner.forget(seq.request_id)
                results.append(
                    RequestOutput(
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
                        queue_seconds=seq.queue_seconds,
                    )
                )
                continue
            out, hit_stop = self.outputs.process(seq)
            if hit_stop and not seq.is_finished:
                self.scheduler.finish(seq, "stop")
            if out.finished:
                self.runner.forget(seq.request_id)
            results.append(out)
        return results

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
            self.scheduler.add(seq)
        final: dict[str, RequestOutput] = {}
        with torch.inference_mode():
            while len(final) < len(seqs):
                for out in self.step():
                    if out.finished:
                        final[out.request_id] = out
        return [final[s.request_id] for s in seqs]

    # ---- stats ---------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "num_free_blocks": self.kv.num_free_blocks,
            "num_blocks": self.config.num_gpu_blocks,
            "kv_usage": self.kv.usage,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_waiting_tokens": self.scheduler.num_waiting_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_computed_prompt_tokens": self.scheduler.num_computed_prompt_tokens,
            "num_prefix_hit_tokens": self.kv.num_hit_tokens,
        }
