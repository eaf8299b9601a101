"""Router: picks one prefill replica and one decode replica per request. Pure Python, no torch.

The policy (RouterConfig.policy: kv, round-robin, least-loaded, random) is a WorkerSelector
(worker_selector.py) that scores one pool's candidates; a caller may pass its own.

"kv" cost of sending a prompt of P tokens to a replica r that holds `cached` of them
(cached = matched leading blocks * block_size, at most P - 1: the last prompt token is always
recomputed to get the first logits), in token-equivalents, lowest wins:

  cost(r) = queue_weight   * (queued_prefill_tokens + pending_tokens)
          + running_weight * (num_running + pending_requests)
          + (P - cached)                       # work left: tokens to prefill / to transfer
          - prefix_weight  * cached            # credit for reuse
          [+ kv_usage_weight * kv_usage]       # decode pool only: room for the new sequence
          [+ adapter_cost(r)]                  # a LoRA request: its adapter's load (adapter_affinity.py)

where cached = device_cached + host_hit_weight * host_cached: blocks in a replica's host KV
tier (kv_offloading_size) extend its device prefix at a discount, as loading them back costs
a fraction of recomputing them. So a device hit beats a host hit beats a miss, other things
equal. The tokens a replica holds in either tier are not recomputed there (decode's local
prefill threshold and the transfer size count them).

It is a weighted trade-off, not an imbalance gate: a prefix holder wins until its extra
queue outweighs (1 + prefix_weight) * cached tokens. The decode replica is chosen first (its
cached blocks need not be transferred); if fewer than local_prefill_threshold uncached tokens
remain there, the decode replica prefills them itself (prefill replica None, no KV moves).
Otherwise the prefill replica is chosen with the same formula over the prefill index, and with
RouterConfig.prefill_placement "measured" the two are weighed in seconds from the replicas'
measured profiles (prefill_placement.py): the decode replica may still prefill locally.

The replicas' books (registration, load reports, KV events, draining) are the Router's base,
ReplicaPools (replica_pools.py); the Router adds the routing over them.

Herding: equal costs are broken by a seeded rng, and every routed request is added to its
replicas' pending counts until their next update_load, so a burst arriving between two load
reports spreads out.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

from splitserve.cluster.routing.adapter_affinity import AdapterHits
from splitserve.cluster.routing.batch_headroom import BatchHeadroom
from splitserve.cluster.routing.load import PendingClaim, ReplicaLoad
from splitserve.cluster.routing.prefill_placement import HandoffEstimate, placement_cost
from splitserve.cluster.routing.replica_pools import DECODE, POOLS, PREFILL, ReplicaPools
from splitserve.cluster.routing.route_decision import RouteDecision
from splitserve.cluster.routing.router_config import RouterConfig
from splitserve.cluster.routing.worker_selector import PoolView, WorkerSelector, make_selector
from splitserve.engine.core.block_hash import hash_blocks, root_hash

# Cost of a completely full decode KV cache in token-equivalents (RouterConfig has no field
# for it): as much as 16 running requests at the default running_weight of 64.
DEFAULT_KV_USAGE_WEIGHT = 1024.0


class NoReplicaError(RuntimeError):
    """A pool has no live, non-draining, non-excluded replica. The frontend answers 503."""

    def __init__(self, pool: str):
        super().__init__(f"no available {pool} replica")
        self.pool = pool


class NoHeadroomError(NoReplicaError):
    """Every live decode replica is past the batch-headroom thresholds: sheddable work must wait."""

    def __init__(self, pool: str):
        super().__init__(pool)
        self.args = (f"no {pool} replica has headroom for batch work; retry later",)


class Router(ReplicaPools):
    """Routing over the replicas' books (ReplicaPools: registration, load reports, KV events)."""

    def __init__(
        self,
        config: RouterConfig | None = None,
        block_size: int = 16,
        *,
        seed: int | None = 0,
        kv_usage_weight: float = DEFAULT_KV_USAGE_WEIGHT,
        allow_local_prefill_fallback: bool = True,
        selector: WorkerSelector | None = None,
        hash_seed: str | None = None,
        batch_headroom: BatchHeadroom | None = None,
    ):
        """hash_seed: the block-hash seed of the engines routed to (their model's, where a
        deployment serves several: engine/core/block_hash.root_hash). allow_local_prefill_fallback: with no prefill replica available (e.g. the pool
        scaled to zero), let the decode replica prefill instead of raising NoReplicaError.
        selector: the scoring policy; None: config.policy's. batch_headroom: where sheddable
        work may go (None: anywhere)."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if kv_usage_weight < 0:
            raise ValueError("kv_usage_weight must be >= 0")
        super().__init__()
        self.config = config if config is not None else RouterConfig()
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.batch_headroom = batch_headroom or BatchHeadroom()
        self._root_hash = root_hash(hash_seed)
        self.kv_usage_weight = kv_usage_weight
        self.allow_local_prefill_fallback = allow_local_prefill_fallback
        self._rng = random.Random(seed)
        self._selector = selector
        self._selectors: dict[str, WorkerSelector] = {}  # by policy, so a new config's policy applies
        self._decisions: Counter[str] = Counter()
        self._adapter_hits = AdapterHits()
        # Remote prefill's hop, as the ingress measures it (observe_remote_handoff).
        self.remote_handoff = HandoffEstimate()

    @property
    def selector(self) -> WorkerSelector:
        if self._selector is not None:
            return self._selector
        policy = self.config.policy
        if policy not in self._selectors:
            self._selectors[policy] = make_selector(policy, self._rng, self.block_size)
        return self._selectors[policy]

    # ---- routing's own counts and estimates (the replicas' queries: ReplicaPools) --------
    def adapter_hit_counts(self) -> dict[str, tuple[int, int]]:
        """pool -> (LoRA requests routed, those sent to a replica whose last report had their
        adapter in its device slots): the adapter-hit share's numerator and denominator."""
        return {pool: self._adapter_hits.counts(pool) for pool in POOLS}

    def observe_remote_handoff(self, seconds: float) -> None:
        """A remote-prefill request's first token came with its handoff stage (the prefill
        call's round trip, the transfer's set-up and wire time): prefill placement prices the
        hop with it."""
        self.remote_handoff.observe(seconds)

    def decision_counts(self) -> dict[str, int]:
        """Decisions so far by reason (for the "router decisions by reason" counter)."""
        return dict(self._decisions)

    # ---- routing -------------------------------------------------------------------------
    def route(
        self,
        prompt_token_ids: Sequence[int] | None = None,
        num_prompt_tokens: int | None = None,
        *,
        block_hashes: Sequence[int] | None = None,
        exclude_prefill: Iterable[Hashable] = (),
        exclude_decode: Iterable[Hashable] = (),
        sheddable: bool = False,
        lora_adapter: str | None = None,
    ) -> RouteDecision:
        """Pick replicas for one prompt, given its token ids or its block hashes (then
        num_prompt_tokens is required). exclude_*: replicas to skip, e.g. on a retry.
        sheddable (batch work): only to decode replicas the batch headroom admits, else
        NoHeadroomError. lora_adapter: the request's adapter, whose blocks hash apart from the
        base's and every other adapter's (as the engines hash them), so a prefix counts only
        where this adapter computed it."""
        hashes, num_tokens = self._prompt_hashes(prompt_token_ids, num_prompt_tokens, block_hashes, lora_adapter)
        decode_cands = self._candidates(DECODE, exclude_decode)
        if not decode_cands:
            raise NoReplicaError(DECODE)
        if sheddable:
            decode_cands = [load for load in decode_cands if self.batch_headroom.admits(load)]
            if not decode_cands:
                raise NoHeadroomError(DECODE)
        prefill_cands = self._candidates(PREFILL, exclude_prefill)
        selector = self.selector
        picked = selector.select(self._view(DECODE, decode_cands, lora_adapter), hashes, num_tokens)
        decode, decode_cached, decode_host = picked.replica, picked.cached_tokens, picked.host_tokens
        remainder = num_tokens - decode_cached
        if remainder < self.config.local_prefill_threshold or not prefill_cands:
            if remainder >= self.config.local_prefill_threshold:
                if not self.allow_local_prefill_fallback:
                    raise NoReplicaError(PREFILL)
                reason = "no-prefill-replica"
            else:
                reason = "local-prefill"
            return self._local(decode, num_tokens, (decode_cached, decode_host), reason, hashes, lora_adapter)

        picked = selector.select(self._view(PREFILL, prefill_cands, lora_adapter), hashes, num_tokens)
        prefill, prefill_cached, reason = picked.replica, picked.cached_tokens, picked.reason
        prefill_host = picked.host_tokens
        if self.config.prefill_placement == "measured":
            cost = placement_cost(
                decode,
                prefill,
                num_tokens,
                remainder,
                num_tokens - prefill_cached,
                self.block_size,
                self.remote_handoff.seconds,
            )
            if cost is not None and cost.local_wins:
                return self._local(decode, num_tokens, (decode_cached, decode_host), cost.reason, hashes, lora_adapter)
            reason = cost.reason if cost is not None else reason  # cold: the threshold rule's remote prefill
        claims: tuple[PendingClaim, ...] = (
            prefill.add_pending(num_tokens - prefill_cached),
            decode.add_pending(0),  # a new sequence on decode; its prompt is prefilled elsewhere
        )
        hits = self._adapter_hits.note(lora_adapter, (PREFILL, prefill), (DECODE, decode))
        return self._decide(
            prefill,
            decode,
            num_tokens,
            (prefill_cached, prefill_host),
            (decode_cached, decode_host),
            remainder,
            reason,
            hashes,
            claims,
            hits,
        )

    def _local(
        self,
        decode: ReplicaLoad,
        num_tokens: int,
        decode_cached: tuple[int, int],
        reason: str,
        hashes: tuple[int, ...],
        lora_adapter: str | None,
    ) -> RouteDecision:
        """The decode replica prefills what it lacks itself: no prefill replica, no KV moves."""
        claims = (decode.add_pending(num_tokens - decode_cached[0]),)
        hits = self._adapter_hits.note(lora_adapter, (DECODE, decode))
        return self._decide(None, decode, num_tokens, (0, 0), decode_cached, 0, reason, hashes, claims, hits)

    def _prompt_hashes(
        self,
        token_ids: Sequence[int] | None,
        num_prompt_tokens: int | None,
        block_hashes: Sequence[int] | None,
        lora_adapter: str | None = None,
    ) -> tuple[tuple[int, ...], int]:
        if (token_ids is None) == (block_hashes is None):
            raise ValueError("pass exactly one of prompt_token_ids and block_hashes")
        if token_ids is not None:
            if num_prompt_tokens is not None and num_prompt_tokens != len(token_ids):
                raise ValueError("num_prompt_tokens disagrees with len(prompt_token_ids)")
            num_prompt_tokens = len(token_ids)
            root = self._root_hash if lora_adapter is None else root_hash(self.hash_seed, lora_adapter)
            hashes = tuple(hash_blocks(token_ids, self.block_size, root))
        else:
            if num_prompt_tokens is None:
                raise ValueError("num_prompt_tokens is required with block_hashes")
            assert block_hashes is not None  # exactly one of the two was given
            hashes = tuple(block_hashes)
            if len(hashes) * self.block_size > num_prompt_tokens:
                raise ValueError(
                    f"{len(hashes)} blocks of {self.block_size} tokens exceed num_prompt_tokens={num_prompt_tokens}"
                )
        if num_prompt_tokens < 1:
            raise ValueError("a prompt needs at least one token")
        return hashes, num_prompt_tokens

    def _view(self, pool: str, cands: list[ReplicaLoad], lora_adapter: str | None) -> PoolView:
        kv_usage_weight = self.kv_usage_weight if pool == DECODE else 0.0
        num_registered = len(self._loads[pool])
        return PoolView(pool, cands, self._indexes[pool], num_registered, kv_usage_weight, self.config, lora_adapter)

    def _decide(
        self,
        prefill: ReplicaLoad | None,
        decode: ReplicaLoad,
        num_tokens: int,
        prefill_cached: tuple[int, int],
        decode_cached: tuple[int, int],
        num_transfer: int,
        reason: str,
        hashes: tuple[int, ...],
        claims: tuple[PendingClaim, ...],
        adapter_hits: tuple[tuple[str, bool], ...] = (),
    ) -> RouteDecision:
        self._decisions[reason] += 1
        return RouteDecision(
            prefill_replica=prefill.replica_id if prefill is not None else None,
            decode_replica=decode.replica_id,
            num_prompt_tokens=num_tokens,
            prefill_cached_tokens=prefill_cached[0],
            decode_cached_tokens=decode_cached[0],
            num_transfer_tokens=num_transfer,
            reason=reason,
            block_hashes=hashes,
            claims=claims,
            prefill_host_cached_tokens=prefill_cached[1],
            decode_host_cached_tokens=decode_cached[1],
            adapter_hits=adapter_hits,
        )
