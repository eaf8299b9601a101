"""EngineStats: what LLMEngine.stats() reports (pure data, no torch).

A msgspec Struct, so a replica's poll reply (splitserve.proto.messages.poll_reply) carries it as is.
"""

from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_free_blocks: int  # KV blocks nobody holds (cached ones included: they are evictable)
    num_blocks: int  # KV blocks in the pool
    kv_usage: float  # fraction of KV blocks held, 0..1
    num_running: int  # requests in the running batch
    num_waiting: int  # requests queued, not yet running
    num_waiting_tokens: int  # tokens the waiting requests still have to prefill
    num_preemptions: int  # since start
    num_computed_prompt_tokens: int  # prompt tokens computed since start (prefix-cache hits excluded)
    num_prefix_hit_tokens: int  # prompt tokens served from the prefix cache since start
    kv_block_bytes: int = 0  # bytes of one KV block over all layers (K, V and any scales)
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), fp8 or int8
    # The host KV tier (kv_offloading_size; all 0 when off): its size and blocks in it; since
    # start, blocks written to it (device evictions), read back (loads instead of recompute),
    # dropped for room, prompt tokens served from it (part of num_prefix_hit_tokens), load
    # calls and their seconds, and seconds spent saving evicted blocks.
    host_num_blocks: int = 0
    host_num_used_blocks: int = 0
    host_stored_blocks: int = 0
    host_loaded_blocks: int = 0
    host_evicted_blocks: int = 0
    host_hit_tokens: int = 0
    host_loads: int = 0
    host_load_seconds: float = 0.0
    host_save_seconds: float = 0.0
    # Structured output, since start (engine/structured_output): grammars compiled and cache hits, compile
    # seconds, steps that masked logits, rows masked, seconds those steps waited for and
    # applied masks, seconds computing masks (overlapped with the forward pass).
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_cache_entries: int = 0  # compiled grammars cached now (bounded by GrammarConfig.cache_size)
    grammar_refused: int = 0  # grammars refused: over a limit, invalid or unsatisfiable
    grammar_compile_seconds: float = 0.0
    grammar_mask_steps: int = 0
    grammar_masked_rows: int = 0
    grammar_mask_seconds: float = 0.0
    grammar_fill_seconds: float = 0.0
    # Speculative decoding, since start (engine/speculative): the method ("none" when off), drafts
    # verified, draft tokens proposed and accepted, tokens emitted by verify steps (accepted +
    # one each), and per k the decoding sequence-steps the policy chose k for (0: none).
    spec_method: str = "none"
    spec_num_drafts: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_emitted_tokens: int = 0
    spec_k_histogram: list[int] = msgspec.field(default_factory=list)
    # Step timing since start (engine/step_timing.py): whether async scheduling is on, steps
    # timed, seconds in forward passes, the engine loop's host work around them, and the part
    # of that host work the forward passes waited for (overlap = 1 - exposed / host).
    async_scheduling: bool = False
    # LoRA (engine/lora/; both 0 when off): the device's adapter slots and those holding an adapter.
    lora_slots: int = 0
    lora_slots_used: int = 0
    # The adapters resident in the device's slots and in the host cache (max_cpu_loras) now;
    # since start, by tier ("device": host -> slot copies, "host": reads from the adapter's
    # directory), loads, evictions and load seconds, and the last loads' seconds (oldest first;
    # the controller's histogram takes those past the loads it has seen).
    lora_device_adapters: list[str] = msgspec.field(default_factory=list)
    lora_host_adapters: list[str] = msgspec.field(default_factory=list)
    lora_loads: dict[str, int] = msgspec.field(default_factory=dict)
    lora_evictions: dict[str, int] = msgspec.field(default_factory=dict)
    lora_load_seconds: dict[str, float] = msgspec.field(default_factory=dict)
    lora_recent_load_seconds: dict[str, list[float]] = msgspec.field(default_factory=dict)
    num_timed_steps: int = 0
    step_forward_seconds: float = 0.0
    step_host_seconds: float = 0.0
    step_exposed_host_seconds: float = 0.0
    # The step cost profile (engine/step_cost_profile.py; 0.0 until measured): a prefilling
    # step's forward seconds as step + per_token * tokens (a line through the recent steps),
    # one line for a fresh prompt's step alone (fresh_*: the CPU's scripted prefill) and one
    # for every other prefilling step (a prompt's tail, chunks, mixed steps: the eager forward),
    # and an EWMA of the seconds of steps that only decode. The router weighs local against
    # remote prefill with them.
    prefill_seconds_per_token: float = 0.0
    decode_step_seconds: float = 0.0
    prefill_step_seconds: float = 0.0
    fresh_prefill_seconds_per_token: float = 0.0
    fresh_prefill_step_seconds: float = 0.0
    # Preemptions since start by the preempted request's priority (SamplingParams.priority).
    preemptions_by_priority: dict[int, int] = msgspec.field(default_factory=dict)
