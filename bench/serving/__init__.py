"""Benchmarks of a served deployment (`splitserve serve`, or the real HTTP app and ingress in
process): hostile traffic and worker memory, structured-output overhead, Batch API priority,
tenant enforcement, and where a served run's CPU went."""
