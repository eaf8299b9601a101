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
    """The prompt's KV is in place: append the first token, emit it, join the running batch.

    A constrained request's matcher replays the token the prefill replica accepted under the
    same grammar (its whole grammar state: the tokens accepted so far)."""
    if seq.grammar is not None and not seq.grammar.accept_token(result.first_token):
        engine.kv.free(seq)  # not in the scheduler yet: free its reserved blocks here
        raise RuntimeError(
            f"the prefill replica's first token {result.first_token} breaks the request's grammar "
            f"({seq.grammar.error.strip()}); is it running an older splitserve?"
        )
    seq.num_computed_tokens = seq.num_prompt_tokens
    seq.num_cached_tokens = result.num_cached_tokens
    seq.append_token(result.first_token, result.first_logprob if seq.params.logprobs else None)
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
