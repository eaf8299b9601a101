"""RouteDecision: the router's answer for one prompt -- its replicas, what each holds of it,
what moves between them, why, and the request's claims on their pending load."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from splitserve.cluster.routing.load import PendingClaim


@dataclass(frozen=True)
class RouteDecision:
    prefill_replica: Hashable | None  # None: the decode replica prefills locally
    decode_replica: Hashable
    num_prompt_tokens: int
    prefill_cached_tokens: int  # prompt tokens cached on the prefill replica, either tier (0 if None)
    decode_cached_tokens: int  # prompt tokens already cached on the decode replica, either tier
    num_transfer_tokens: int  # KV tokens to move prefill -> decode (0 if local)
    reason: str  # "kv-prefix", "load", "local-prefill", ...
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's full blocks
    # The request's shares of the chosen replicas' pending load (prefill's first, if any):
    # the caller releases each when the request leaves that replica (release_claims).
    claims: tuple[PendingClaim, ...] = field(default=(), compare=False, repr=False)
    # Of the cached tokens above, those in the replica's host tier (loaded back, not recomputed).
    prefill_host_cached_tokens: int = 0
    decode_host_cached_tokens: int = 0
    # A LoRA request: per pool routed to, whether that replica reported its adapter in its
    # device slots (the adapter-hit share's samples; empty for the base model).
    adapter_hits: tuple[tuple[str, bool], ...] = ()

    @property
    def local_prefill(self) -> bool:
        return self.prefill_replica is None

    def release_prefill(self) -> None:
        """The prompt left the prefill replica's queue (its first token came back)."""
        if not self.local_prefill and self.claims:
            self.claims[0].release()

    def release_claims(self) -> None:
        """The request ended (or was never sent): it no longer loads any replica it was routed to."""
        for claim in self.claims:
            claim.release()
