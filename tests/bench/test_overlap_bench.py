"""bench/engine/overlap.py on the tiny model, splitserve only: both step modes and the BLAS baseline
run every cell, the modes decode the same greedy tokens (the run raises otherwise) and the
tables carry every column."""

from __future__ import annotations

import os

from splitserve.bench.engine import overlap
from splitserve.engine.ops.onednn_packed_weight import CPU_MATMUL_ENV


def test_shared_prefix_prompts_share_three_quarters():
    prompts = overlap.make_prompts("shared-prefix", 1, 8, 32, 500)
    assert len(prompts) == 8 and all(len(p) == 32 for p in prompts)
    assert prompts[0][:24] == prompts[4][:24] != prompts[1][:24]
    assert prompts[0][24:] != prompts[4][24:]
    distinct = overlap.make_prompts("distinct", 1, 8, 32, 500)
    assert len({tuple(p[:24]) for p in distinct}) == 8


def test_a_small_run_reports_both_modes(tiny_model, tmp_path):
    out = tmp_path / "overlap.md"
    argv = ["--model", tiny_model, "--batch-sizes", "1,3", "--max-tokens", "5", "--prompt-len", "16", "--repeats", "1"]
    before = os.environ.get(CPU_MATMUL_ENV)
    assert overlap.main([*argv, "--out", str(out)]) == 0
    assert os.environ.get(CPU_MATMUL_ENV) == before  # the blas engine's switch does not outlive its load
    text = out.read_text()
    for workload in ("**shared-prefix**", "**distinct**"):
        assert workload in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(cells[i].replace(",", "")) > 0 for i in (1, 2, 3))  # blas, sync, overlap tok/s
        assert cells[4].endswith("x") and cells[5].endswith("x") and "%" in cells[-1]
        assert len(cells[6].split(" / ")) == 3  # CPU per token of sync, overlap and blas
