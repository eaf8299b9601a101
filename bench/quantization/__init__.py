"""Quantization's trade-offs on a trained checkpoint: weight schemes (bytes, perplexity, greedy
agreement, decode speed) and the fp8/int8 KV cache (scale granularity, quality, capacity, handoff
bytes)."""
