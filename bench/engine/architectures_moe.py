"""The mixture-of-experts part of bench/engine/architectures.py, and the report of all three parts.

moe_breakdown: one decoder layer's MLP of each model on the same normed hidden states (batch 1
and 32): the dense model's gate_up / activation / down against the Mixtral's SparseMoeMlp, its
wall time, and torch.profiler's top-level ops of the MoE call grouped as routing (router
matmul, softmax, top-k, renormalising), sort/count (grouping the choices by expert), gather
(each expert's tokens and weights), expert matmuls, activation, scatter (index_add_ back per
token), and the host time between ops (the Python loop over the experts).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

CATEGORIES = {
    "routing": ("aten::linear", "aten::softmax", "aten::topk", "aten::sum", "aten::div", "aten::to"),
    "sort/count": ("aten::argsort", "aten::bincount", "aten::reshape", "aten::slice"),
    "gather": ("aten::index_select",),
    "expert matmuls": ("mkldnn::_linear_pointwise",),
    "activation": ("aten::silu", "aten::mul_"),
    "scatter": ("aten::cat", "aten::mul", "aten::index_add_", "aten::zeros_like"),
}


def _dense_mlp(layer, x):
    from splitserve.engine.quant.quantize import linear

    gate_up = linear(x, layer.gate_up_weight)
    act = layer.activation(gate_up[:, : layer.intermediate_size]).mul_(gate_up[:, layer.intermediate_size :])
    return linear(act, layer.down_weight)


def _median_ms(fn, reps: int = 50) -> float:
    """Median thread CPU ms of fn() (one torch thread: its work runs on this thread)."""
    for _ in range(5):
        fn()
    samples = []
    for _ in range(reps):
        started = time.thread_time()
        fn()
        samples.append((time.thread_time() - started) * 1e3)
    return statistics.median(samples)


def _shares(moe, x, activation) -> dict[str, float]:
    """Each category's share of the MoE call's wall time, as the profiler times its top-level ops
    (host: the time between them: Python, dispatch, the profiler's own bookkeeping)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(20):
            moe(x, activation)
        wall_us = (time.perf_counter() - started) * 1e6
    totals = dict.fromkeys(CATEGORIES, 0.0)
    totals["other ops"] = 0.0
    for event in prof.events():
        if event.cpu_parent is not None:
            continue
        category = next((c for c, names in CATEGORIES.items() if event.name in names), "other ops")
        totals[category] += event.cpu_time_total
    totals["host between ops"] = max(wall_us - sum(totals.values()), 0.0)
    return {category: us / wall_us for category, us in totals.items()}


def moe_breakdown(versus: dict[str, Path], repeats: int) -> dict:
    import torch

    from splitserve.engine.model.loader import load_model

    (dense_name, dense_path), (moe_name, moe_path) = list(versus.items())[:2]
    dense_layer = load_model(dense_path)[0].layers[0]
    moe_layer = load_model(moe_path)[0].layers[0]
    rows = {}
    for batch in (1, 32):
        x = torch.randn(batch, dense_layer.input_norm.shape[0], generator=torch.Generator().manual_seed(batch))
        dense_ms, moe_ms = [], []
        with torch.inference_mode():
            for _ in range(repeats):
                dense_ms.append(_median_ms(lambda: _dense_mlp(dense_layer, x)))  # noqa: B023
                moe_ms.append(_median_ms(lambda: moe_layer.moe(x, moe_layer.activation)))  # noqa: B023
            shares = _shares(moe_layer.moe, x, moe_layer.activation)
        rows[batch] = {"dense_ms": statistics.median(dense_ms), "moe_ms": statistics.median(moe_ms), "shares": shares}
    return {"dense": dense_name, "moe": moe_name, "batches": rows}


def report(results: dict) -> str:
    lines = ["## Decode, bench preset (tok/s; CPU ms per step)", ""]
    lines += ["| architecture | tok/s b=1 | tok/s b=32 | CPU ms/step b=1 | CPU ms/step b=32 |", "|---|---|---|---|---|"]
    for name, r in {**results["decode"], **results["moe"]}.items():
        lines.append(
            f"| {name} | {r[1]['tok_s']:.1f} | {r[32]['tok_s']:.1f} | {r[1]['cpu_ms']:.2f} | {r[32]['cpu_ms']:.2f} |"
        )
    breakdown = results["moe_breakdown"]
    lines += ["", f"## One layer's MLP: {breakdown['dense']} vs {breakdown['moe']} (thread CPU ms; shares of wall)", ""]
    categories = list(next(iter(breakdown["batches"].values()))["shares"])
    lines += ["| batch | dense ms | MoE ms | ratio | " + " | ".join(categories) + " |"]
    lines += ["|---" * (4 + len(categories)) + "|"]
    for batch, row in breakdown["batches"].items():
        shares = " | ".join(f"{row['shares'][c]:.0%}" for c in categories)
        ratio = row["moe_ms"] / row["dense_ms"]
        lines.append(f"| {batch} | {row['dense_ms']:.3f} | {row['moe_ms']:.3f} | {ratio:.2f} | {shares} |")
    lines += ["", "## KV blocks held at a context of 4x the window (8 sequences)", ""]
    lines += [
        "| model | blocks held | blocks the context needs | held / needed | decode tok/s |",
        "|---|---|---|---|---|",
    ]
    for name, row in results["window"].items():
        held, needed = row["held"], row["needed"]
        lines.append(f"| {name} | {held} | {needed} | {held / needed:.2f} | {row['tok_s']:.1f} |")
    return "\n".join(lines) + "\n"
