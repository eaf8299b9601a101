"""The prefill -> decode handoff by hand, without Ray or a transport: a prefill-only engine
and a decode engine in one process, the KV copied between their caches."""

from __future__ import annotations

from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.handoff import PrefillResult
from splitserve.proto.messages.sampling_params import SamplingParams


def run_prefill(engine: LLMEngine, ids: list[int], params: SamplingParams, request_id: str) -> RequestOutput:
    engine.add_sequence(engine.make_sequence(None, ids, params, request_id, prefill_only=True))
    for _ in range(100):
        outs = engine.step()
        if outs:
            return outs[0]  # a prefill-only request has one output: its first token
    raise AssertionError("prefill did not finish")


def hand_off(
    prefill: LLMEngine, decode: LLMEngine, ids, params, request_id, early: bool = False
) -> tuple[RequestOutput, list[int]]:
    """What the workers do over the wire: reserve on decode, prefill, copy the missing blocks,
    unpin them on prefill, admit on decode. Returns the first output and the received indices.
    early: the first token is accepted before the KV is copied (an early first token); its
    output then comes from accept_first_token, where the engine takes it early."""
    seq = decode.make_sequence(None, ids, params, request_id)
    reservation = decode.reserve_prompt_blocks(seq)
    assert reservation is not None
    first = run_prefill(prefill, ids, params, request_id)
    result = PrefillResult(
        request_id=request_id,
        first_token=first.new_token_ids[0],
        first_logprob=first.new_logprobs[0] if first.new_logprobs else None,
        first_top_logprobs=first.new_top_logprobs[0] if first.new_top_logprobs else [],
        num_cached_tokens=first.num_cached_tokens,
        num_blocks_sent=len(reservation.block_indices),
        num_bytes_sent=0,
        prefill_seconds=0.0,
        transfer_seconds=0.0,
        prompt_logprobs=first.prompt_logprobs,
        prompt_top_logprobs=first.prompt_top_logprobs,
        prompt_ranks=first.prompt_ranks,
    )
    early_out = decode.accept_first_token(request_id, result) if early else None
    src_ids = prefill.prompt_block_ids(request_id, reservation.block_indices)
    decode.kv_cache.kv[:, :, reservation.block_ids] = prefill.kv_cache.kv[:, :, src_ids]
    prefill.release_prefilled(request_id)
    out = decode.admit_prefilled(request_id, result)
    assert (out is None) == (early_out is not None)
    return early_out or out, reservation.block_indices


def finish_all(engine: LLMEngine, outputs: dict[str, list[RequestOutput]]) -> None:
    for _ in range(200):
        if not engine.has_unfinished():
            return
        for out in engine.step():
            outputs[out.request_id].append(out)
    raise AssertionError("requests did not finish")
