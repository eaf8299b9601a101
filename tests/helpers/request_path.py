"""The cluster and the prompts of the request-path tests (test_request_path.py and its framing
half, test_token_stream.py): two prefill replicas and one decode replica routed by KV prefix
hits, and prompts that share a 2-block prefix so that routing has something to match."""

from __future__ import annotations

from splitserve.cluster.config import ServeConfig
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import cluster_config

LEASE_S = 5.0
SHARED = [(11 * i) % 300 + 40 for i in range(32)]  # a 2-block prefix every prompt here shares
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def request_path_config(model_dir: str) -> ServeConfig:
    """2 prefill + 1 decode replicas, KV-aware routing, room for the long streams' blocks."""
    return cluster_config(model_dir, num_prefill=2, num_decode=1, policy="kv", lease_s=LEASE_S, num_blocks=256)
