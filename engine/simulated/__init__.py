"""The simulated engine: the real scheduler, block pool, prefix cache and KV events around a
step-time model instead of a model forward. Torch-free: dozens of replicas fit on one box."""
