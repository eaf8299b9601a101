"""bench/overlap.py on the tiny model, splitserve only: both step modes run every cell, decode
the same greedy tokens (the run raises otherwise) and the tables carry every column."""

from __future__ import annotations

from splitserve.bench import overlap


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
    assert overlap.main([*argv, "--out", str(out)]) == 0
    text = out.read_text()
    for workload in ("**shared-prefix**", "**distinct**"):
        assert workload in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 3 |")]
    assert len(rows) == 4
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert float(cells[1].replace(",", "")) > 0 and float(cells[2].replace(",", "")) > 0
        assert cells[3].endswith("x") and "%" in cells[-1]
