"""Admission: how many requests one ingress replica takes at once, whatever model they ask for.

Shared by the ServingBackends of every model the replica serves, so `max_queued_requests` and
`max_requests_per_key` bound the replica as a user expects (one queue, not one per model).
Interactive requests count against both limits; batch work (sheddable) is outside them (each
model's backend checks its own decode replicas' headroom for it). Per-key fairness applies to
clients told apart by the operator's api_key; with tenants configured their gate does that.
"""

from __future__ import annotations

from collections import defaultdict

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.request_error import ErrorKind, RequestError


class Admission:
    def __init__(self, cfg: ServeConfig):
        self.max_queued_requests = cfg.max_queued_requests
        self.max_requests_per_key = cfg.max_requests_per_key
        self.per_key = bool(cfg.api_key) and not (cfg.tenants or cfg.tenants_file)
        self.num_inflight = 0  # interactive requests of every model: what max_queued_requests bounds
        self.num_sheddable_inflight = 0  # batch requests, outside that bound
        self._inflight_by_key: dict[str, int] = defaultdict(int)

    def admit(self, api_key: str | None, sheddable: bool) -> str | None:
        """Count a request in, or raise RequestError(OVERLOADED). Returns the key it was counted
        under (None: none), which release() takes back."""
        key = (api_key or "") if self.per_key and not sheddable else None
        if not sheddable and self.num_inflight >= self.max_queued_requests:
            raise RequestError(ErrorKind.OVERLOADED, "the server is at capacity; retry later")
        if key is not None and self._inflight_by_key[key] >= self.max_requests_per_key:
            raise RequestError(ErrorKind.OVERLOADED, "too many concurrent requests for this API key")
        if sheddable:
            self.num_sheddable_inflight += 1
        else:
            self.num_inflight += 1
        if key is not None:
            self._inflight_by_key[key] += 1
        return key

    def release(self, key: str | None, sheddable: bool) -> None:
        if sheddable:
            self.num_sheddable_inflight -= 1
        else:
            self.num_inflight -= 1
        if key is not None:
            self._inflight_by_key[key] -= 1
            if not self._inflight_by_key[key]:
                del self._inflight_by_key[key]
