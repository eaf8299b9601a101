"""Building a request's Sequence from an asyncio actor without stalling anything.

An unconstrained request's Sequence is built inline (cheap). A constrained one needs its
grammar compiled, which for a big schema can take long: that runs on a worker thread, never
on the engine loop thread or the event loop, so other requests keep streaming; and within
the request's deadline, so compile time counts toward it like any other work.
"""

from __future__ import annotations

import asyncio
import time

from splitserve.engine.core.sequence import Sequence
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.engine.llm_engine import LLMEngine


async def make_sequence_async(
    engine: LLMEngine,
    prompt_token_ids: list[int],
    params: SamplingParams,
    request_id: str,
    prefill_only: bool = False,
    deadline: float | None = None,
) -> Sequence:
    """engine.make_sequence; raises InvalidRequestError for bad input (an invalid grammar
    included) and TimeoutError when the grammar is not compiled by deadline (time.time())."""
    if params.structured_output is None:
        return engine.make_sequence(None, prompt_token_ids, params, request_id, prefill_only=prefill_only)
    build = asyncio.to_thread(
        engine.make_sequence, None, prompt_token_ids, params, request_id, prefill_only=prefill_only
    )
    timeout = None if deadline is None else max(deadline - time.time(), 0.001)
    return await asyncio.wait_for(build, timeout)
