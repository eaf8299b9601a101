"""metered: a generation's chunks, telling its tenant ticket part what it used when it ends
(however it ends), so the tenant's reservation settles to the real count."""

from __future__ import annotations

from collections.abc import AsyncIterator

from splitserve.cluster.request_error import RequestError
from splitserve.cluster.tenants.tenant_gate import TicketPart
from splitserve.proto.messages.handoff import StreamChunk


async def metered(chunks: AsyncIterator[StreamChunk], part: TicketPart) -> AsyncIterator[StreamChunk]:
    """chunks, telling part the cached and generated tokens at the end (an error: failed)."""
    part.started()
    cached = completion = received = 0
    failed = False
    try:
        async for chunk in chunks:
            cached = max(cached, chunk.num_cached_tokens)
            # As the response's usage counts them (cluster/frontend/openai/choice.py).
            received += len(chunk.token_ids)
            completion = max(completion, chunk.num_output_tokens, received)
            yield chunk
    except RequestError:
        failed = True
        raise
    finally:
        aclose = getattr(chunks, "aclose", None)  # a generator's cleanup aborts the request
        if aclose is not None:
            await aclose()
        part.finished(cached, completion, failed)
