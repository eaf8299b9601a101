"""A request's first token, hop by hop: `splitserve_first_token_stage_seconds{stage}`.

Each stage is a duration measured on the clock of the process where it ran, so no two
machines' clocks are compared:
- ingress (this process): from the HTTP/gRPC request's arrival (before parsing, validation,
  tokenizing and admission) to the backend taking it;
- routing (the dispatcher): from there to the Submit leaving for the decode replica;
- prefill_queue, prefill_compute, handoff, decode_admission (the replicas):
  decode/first_token_clock.py;
- relay: the dispatcher's round trip to the decode replica less the replica's own time: the
  request channel both ways and this event loop's wait.
Their sum is the time from the request's arrival to its first chunk reaching the backend; a
client also sees its own connection and the response's rendering, which no stage holds
(tests/cluster/test_first_token_stages.py states the error).
"""

from __future__ import annotations

import msgspec

from splitserve.proto.messages.handoff import StreamChunk

STAGES = (
    "ingress",
    "routing",
    "prefill_queue",
    "prefill_compute",
    "handoff",
    "decode_admission",
    "relay",
)
# The ASGI scope key where the access log middleware puts the request's arrival (perf_counter).
RECEIVED_AT = "splitserve.received_at"


def with_ingress_stage(chunk: StreamChunk, ingress_s: float | None) -> StreamChunk:
    """The first chunk with the ingress stage among its stages, so that what /metrics observes
    and what the response reports (return_first_token_stages) are the same figures. A chunk
    without stages (a continuation after a migration) stays as it is."""
    if not chunk.first_token_stages or ingress_s is None:
        return chunk
    stages = {**chunk.first_token_stages, "ingress": ingress_s}
    # In the path's order (STAGES), as a report lists them.
    return msgspec.structs.replace(chunk, first_token_stages={s: stages[s] for s in STAGES if s in stages})


def observe_first_token(histogram, chunk: StreamChunk) -> None:
    """One observation per stage the request went through (handoff only with a remote prefill;
    nothing where the chunk carries no stages). Negative durations (clock granularity) count as 0."""
    stages = chunk.first_token_stages
    for stage in STAGES:
        if stage in stages:
            histogram.labels(stage).observe(max(stages[stage], 0.0))
