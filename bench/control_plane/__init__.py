"""The control plane: the router's ingest and decision latency, per-pool autoscaling on a rising and
falling load, and polls, probes and routing at 1-64 simulated replicas (with the step-time profile
the simulated engine is fitted to)."""
