"""Tensor parallelism inside one engine: the shard plan, the rank group, the ranks' processes."""
