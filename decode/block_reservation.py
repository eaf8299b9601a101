"""Loop-thread helpers: reserve a prompt's blocks before a transfer, admit it afterwards."""

from __future__ import annotations

from splitserve.engine.core.sequence import Sequence
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.llm_engine import LLMEngine
from splitserve.kvtransfer.handoff import PrefillResult


def reserve_prompt_blocks(engine: LLMEngine, seq: Sequence) -> tuple[list[int], list[int]] | None:
    """Reuse every cached full block of the prompt, allocate the rest. Returns (indices of the
    prompt blocks to receive, the local blocks they go to), or None if blocks are short."""
    kv = engine.kv
    cached = kv.find_cached_blocks(seq, max_tokens=seq.num_prompt_tokens)
    num_cached_tokens = len(cached) * kv.block_size
    if not kv.allocate_prompt(seq, cached, seq.num_prompt_tokens - num_cached_tokens):
        return None
    # Ordered by destination block: a run of ascending ids is received in place, no unpacking.
    pairs = sorted(
        ((i, seq.block_table[i]) for i in range(len(cached), len(seq.block_table))), key=lambda pair: pair[1]
    )
    return [i for i, _ in pairs], [b for _, b in pairs]


def admit_prefilled(engine: LLMEngine, seq: Sequence, result: PrefillResult, sink, loop: EngineLoop) -> None:
    """The prompt's KV is in place: append the first token, emit it, join the running batch."""
    seq.num_computed_tokens = seq.num_prompt_tokens
    seq.num_cached_tokens = result.num_cached_tokens
    seq.queue_seconds = result.queue_seconds
    top = [(int(t), float(lp)) for t, lp in result.first_top_logprobs] if seq.params.top_logprobs else None
    seq.append_token(result.first_token, result.first_logprob if seq.params.logprobs else None, top)
    reason = engine.scheduler.check_stop(seq)
    engine.scheduler.add_prefilled(seq)  # also enters its received full blocks into the cache
    if reason is not None:
        engine.scheduler.finish(seq, reason)
    out, hit_stop = engine.outputs.process(seq)
    if hit_stop and not seq.is_finished:
        engine.scheduler.finish(seq, "stop")
    if out.finished:
        engine.runner.forget(seq.request_id)
    else:
        loop.register_sink(seq.request_id, sink)
    sink(out)
