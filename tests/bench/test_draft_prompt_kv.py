"""bench/kv_transfer/draft_prompt_kv.py at toy size: times the draft's local prompt pass, sizes its KV,
and reads the KV path's rate from the committed transfer results."""

from __future__ import annotations

from splitserve.bench.kv_transfer.draft_prompt_kv import kv_path_gbps, main, measure


def test_measures_the_local_prefill_and_reads_the_transfer_rate(tiny_model, tmp_path):
    assert 0.01 < kv_path_gbps() < 100
    rows = measure(tiny_model, lengths=(16, 64), repeats=1)
    assert [r["tokens"] for r in rows] == [16, 64]
    assert all(r["prefill_ms"] > 0 for r in rows)
    # tiny: 2 layers x K,V x 2 KV heads x head_dim 16 x fp32 = 512 bytes per token
    assert [r["kv_bytes"] for r in rows] == [16 * 512, 64 * 512]
    out = tmp_path / "report.md"
    assert main(["--draft", tiny_model, "--out", str(out), "--lengths", "32,128"]) == 0
    text = out.read_text()
    assert "Commit:" in text and "| 128 |" in text
