"""PlannerConfig: the live `sla` autoscaling policy's settings (cluster/scaling/sla_policy.py).
ServeConfig nests it as `planner`, so its CLI flags (--planner.gpu-budget ...), the YAML file
and the Helm schema derive from it. The SLOs are the pools' own: prefill.autoscaling.ttft_target_ms
and decode.autoscaling.itl_target_ms."""

from __future__ import annotations

from pydantic import Field

from splitserve.cluster.pool_config import StrictConfig


class PlannerConfig(StrictConfig):
    profile: str | None = None
    """Step-time profile the `sla` policy sizes the pools with (a shipped name or a file; `splitserve plan`'s); unset: engine_profile."""
    gpu_budget: int | None = Field(None, ge=1)
    """Most GPUs the `sla` policy may hold over both pools (a replica holds its pool's tensor_parallel_size x num_gpus, at least 1); unset: the pools' max_replicas bound it."""
    startup_s: float = Field(30.0, ge=0)
    """Seconds a new replica takes to serve: the `sla` policy sizes for the load forecast this far (plus one interval) ahead, so a replica started now serves when that load arrives."""
    # 15 s, not 30: on the bursty benchmark (bench/results/sla_planner.md) two 30 s windows saw
    # the ramp out of the trough ~20 s later, goodput 0.871 against 0.931 at the same GPU-hours.
    window_s: float = Field(15.0, gt=0)
    """Seconds of observed arrivals each rate estimate is over; the trend is the change between the last two windows."""
    percentile: float = Field(90.0, gt=0, lt=100)
    """Percentile at which TTFT and ITL must meet their targets."""
    num_requests: int = Field(400, ge=50)
    """Requests of the forecast workload each sizing simulates (more: steadier predictions, slower decisions)."""
