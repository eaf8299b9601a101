"""The model-routing benchmark's end-to-end check: the same evaluation prompts through two real
in-process clusters (one ServingBackend per model, its own controller and decode pool) and the
real CascadeRoute, one request at a time: TTFT as the frontend sees it per policy, and whether
the cascade's decisions and answers match the offline measurement (bench/models/model_routing.py)."""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.model_router.cascade_route import CascadeRoute
from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_calibration import PromptMeasure
from splitserve.cluster.frontend.serving_api import ChoiceRequest
from splitserve.cluster.model_route_config import ModelRouteConfig
from splitserve.proto.messages.sampling_params import SamplingParams

POLICIES = ("always-large", "always-small", "cascade")


def backend_config(model_dir: Path, name: str) -> ServeConfig:
    """One decode replica that prefills locally, one CPU and one torch thread."""
    pool = {"replicas": 1, "resources": {"num_cpus": 1}, "torch_threads": 1, "num_kv_blocks": 256}
    return ServeConfig.model_validate(
        {"model": str(model_dir), "served_model_name": name, "prefill": {"replicas": 0}, "decode": pool}
    )


async def _run(small_dir, large_dir, prompts, threshold, window, max_tokens):
    from splitserve.cluster.frontend.backend import ServingBackend

    backends = {}
    try:
        for name, model_dir in (("small", small_dir), ("large", large_dir)):
            backends[name] = ServingBackend(backend_config(model_dir, name), str(model_dir))
            await backends[name].start()
        cascade = {"small": "small", "large": "large", "window_tokens": window, "threshold": threshold}
        config = ModelRouteConfig.model_validate({"name": "auto", "policy": "cascade", "cascade": cascade})
        route = CascadeRoute(config, backends, ModelRouteMetrics())
        results: dict[str, list] = {policy: [] for policy in POLICIES}
        for m in prompts:
            ids = backends["small"].tokenizer.encode(m.prompt)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            apis = (backends["large"], backends["small"], route.bind(RequestFeatures(ids, params)))
            for policy, api in zip(POLICIES, apis):
                start, first, tokens = time.perf_counter(), None, []
                async for chunk in api.generate(ChoiceRequest(ids, params)):
                    first = first if first is not None else time.perf_counter() - start
                    tokens += chunk.token_ids
                results[policy].append((first, tokens, getattr(api, "decision", None)))
        return results
    finally:
        for backend in backends.values():
            await backend.shutdown()


def through_cluster(
    small_dir: Path, large_dir: Path, prompts: list[PromptMeasure], threshold: float, window: int, max_tokens: int
) -> list[str]:
    """Markdown lines: TTFT per policy through the clusters, and the cascade's agreement."""
    import ray

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(
        num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level="ERROR", log_to_driver=False
    )
    try:
        results = asyncio.run(_run(small_dir, large_dir, prompts, threshold, window, max_tokens))
    finally:
        ray.shutdown()
    cascade = results["cascade"]
    agree = sum((d.reason == "confident") == (m.confidence >= threshold) for m, (_, _, d) in zip(prompts, cascade))
    same = sum(
        tokens == (m.small_answer if d.reason == "confident" else m.large_answer)
        for m, (_, tokens, d) in zip(prompts, cascade)
    )
    lines = [
        "| policy (through the clusters) | mean TTFT (ms) | median TTFT (ms) |",
        "|---|---|---|",
    ]
    for policy in POLICIES:
        ttfts = [1000 * first for first, _, _ in results[policy]]
        lines.append(f"| {policy} | {statistics.fmean(ttfts):.1f} | {statistics.median(ttfts):.1f} |")
    lines += [
        "",
        f"Cascade at threshold {threshold:.3f} through the clusters: {agree}/{len(prompts)} decisions as measured "
        f"offline, {same}/{len(prompts)} answers token for token the offline answer of the model that answered, "
        f"{sum(d.reason == 'escalated' for _, _, d in cascade)} escalations.",
    ]
    return lines
