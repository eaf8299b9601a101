"""The control plane's settings in ServeConfig: the ingress deployment (its replicas and Ray
Serve autoscaling), the controller (replacement backoff) and the replicas' pushed state."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from splitserve.cluster.pool_config import StrictConfig as _Strict


class IngressAutoscalingConfig(_Strict):
    """Ray Serve autoscaling of the ingress deployment on ongoing requests per replica."""

    enabled: bool = False
    """Scale the ingress replicas between min_replicas and max_replicas (Ray Serve)."""
    min_replicas: int = Field(1, ge=1)
    """Ingress autoscaling floor."""
    max_replicas: int = Field(4, ge=1)
    """Ingress autoscaling ceiling."""
    target_ongoing_requests: float = Field(64.0, gt=0)
    """Requests in flight per ingress replica to aim for."""
    upscale_delay_s: float = Field(30.0, ge=0)
    """How long the load must stay high before Serve adds an ingress replica."""
    downscale_delay_s: float = Field(600.0, ge=0)
    """How long the load must stay low before Serve removes an ingress replica."""

    @model_validator(mode="after")
    def _check_bounds(self) -> IngressAutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self


class IngressConfig(_Strict):
    """The stateless ingress replicas: HTTP, gRPC, tokenizer, router and dispatcher each."""

    replicas: int = Field(1, ge=1)
    """Ingress replicas (without autoscaling)."""
    autoscaling: IngressAutoscalingConfig = Field(default_factory=IngressAutoscalingConfig)
    """Ray Serve autoscaling of the ingress replicas."""
    num_cpus: float = Field(0.0, ge=0)
    """CPUs each ingress replica asks Ray for."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources per ingress replica, e.g. {"node:__internal_head__": 0.001} keeps them on
    the head node, where a Kubernetes Service or port forwarding points; empty: any node."""


class ControllerConfig(_Strict):
    """The controller: pool membership, health, replacement, autoscaling and drain."""

    probe_interval_s: float = Field(0.5, gt=0)
    """Seconds between the controller's health and load probes of every replica."""
    restart_backoff_s: float = Field(1.0, gt=0)
    """Delay before a pool retries a replica that failed to start or died young; doubles per failure."""
    restart_backoff_max_s: float = Field(60.0, gt=0)
    """Longest delay between a pool's replica restarts."""
    healthy_after_s: float = Field(30.0, gt=0)
    """A replica serving this long resets its pool's restart backoff; one dying younger counts as a failure."""
    ingress_timeout_s: float = Field(10.0, gt=0)
    """An ingress silent this long is gone: drains stop waiting for it, its metrics retire."""

    @model_validator(mode="after")
    def _check_backoff(self) -> ControllerConfig:
        if self.restart_backoff_s > self.restart_backoff_max_s:
            raise ValueError("restart_backoff_s must be <= restart_backoff_max_s")
        return self


class ReplicaStateConfig(_Strict):
    """How every ingress follows each replica's KV events and load (its router's view)."""

    updates: Literal["push", "poll"] = "push"
    """push: each replica pushes its KV events and load to the subscribed ingresses over their request channel (coalesced, on change); poll: each ingress polls each replica every poll_interval_s (a Ray call each; cost grows with replicas x ingresses)."""
    push_interval_s: float = Field(0.1, gt=0)
    """A replica pushes what changed at most this often (KV events and load are coalesced in between)."""
    heartbeat_s: float = Field(1.0, gt=0)
    """A replica with nothing new pushes a heartbeat this often; after 3 missed ones the ingress polls it instead."""
    poll_interval_s: float = Field(0.1, gt=0)
    """Seconds between an ingress's polls of every replica (updates: poll)."""

    @model_validator(mode="after")
    def _check_heartbeat(self) -> ReplicaStateConfig:
        if self.heartbeat_s < self.push_interval_s:
            raise ValueError("heartbeat_s must be >= push_interval_s")
        return self
