"""RouterConfig: the router's settings, validated (pydantic). ServeConfig nests it as `router`,
so the CLI flags, the YAML file and the Helm schema all derive from it. It lives next to the
router so that routing imports nothing of the rest of the service (no torch, no model code)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

RouterPolicy = Literal["kv", "round-robin", "least-loaded", "random"]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)
PrefillPlacement = Literal["threshold", "measured"]
# A LoRA adapter's load in prefill tokens, measured on CPU (bench/results/lora_load_cost.md:
# rank 16 on every target of an 8-layer, 512-wide model): from its checkpoint to a device
# slot, and from the host to a slot.
ADAPTER_LOAD_TOKENS = 8.4
ADAPTER_HOST_LOAD_TOKENS = 3.7


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    policy: RouterPolicy = "kv"
    """Routing policy: kv (prefix-cache aware), round-robin, least-loaded or random."""
    prefix_weight: float = Field(1.0, ge=0)
    """kv policy: credit per cached prompt token."""
    queue_weight: float = Field(1.0, ge=0)
    """kv policy: cost per queued prefill token."""
    running_weight: float = Field(64.0, ge=0)
    """kv policy: cost per running request."""
    host_hit_weight: float = Field(0.99, ge=0, le=1)
    """kv policy: a prompt token in a replica's host KV tier counts as this fraction of one on
    its device: 1 - load time / recompute time per block, measured 0.995-0.999 on CPU
    (bench/results/kv_offload.md); gpu_check's offload check measures it on a GPU."""
    local_prefill_threshold: int = Field(32, ge=0)
    """Conditional disaggregation: when fewer uncached prompt tokens than this remain on the
    chosen decode replica, it prefills them itself and no KV moves (under either
    prefill_placement: an override)."""
    # Default "threshold": `local_prefill_threshold: 0` has meant "every prompt to the prefill
    # pool" -- the tests that cover the remote path (test_request_path, test_kv_quant_disagg,
    # the frontend's echo and quantized tests...) and the bench deployments rely on it; under
    # "measured" an idle decode replica, once measured, would take those prompts itself.
    prefill_placement: PrefillPlacement = "threshold"
    """Where a remainder of local_prefill_threshold tokens or more is prefilled. threshold: on
    a prefill replica, always. measured: where it costs less, from the replicas' measured step
    and transfer profiles -- the decode replica prefilling it inside its running batch (every
    running sequence waits for it) against the prefill replica's queue, prefill and KV
    transfer (cluster/routing/prefill_placement.py); the threshold rule while either replica
    has no measurement yet."""
    adapter_load_tokens: float = Field(ADAPTER_LOAD_TOKENS, ge=0)
    """kv policy: the cost of a LoRA adapter a replica holds in neither its device slots nor
    its host cache (read from its checkpoint, then copied to a slot), in prefill tokens: load
    seconds / prefill seconds per token, measured in bench/results/lora_load_cost.md."""
    adapter_host_load_tokens: float = Field(ADAPTER_HOST_LOAD_TOKENS, ge=0)
    """kv policy: the cost of an adapter in a replica's host cache (copied to a device slot),
    and of evicting one from full slots; in prefill tokens, measured as above."""
