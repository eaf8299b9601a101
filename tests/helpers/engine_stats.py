"""Engine figures for tests of what the controller does with a replica's poll reply."""

from __future__ import annotations

from splitserve.proto.messages.engine_stats import EngineStats

# A replica a quarter full, one request running: the fields every EngineStats needs.
STATS_FIELDS = dict(
    num_free_blocks=48,
    num_blocks=64,
    kv_usage=0.25,
    num_running=1,
    num_waiting=0,
    num_waiting_tokens=0,
    num_preemptions=0,
    num_computed_prompt_tokens=10,
    num_prefix_hit_tokens=0,
)
STATS = EngineStats(**STATS_FIELDS)
