"""bench/models/trained_model.py end to end at toy size: trains, evaluates and writes its report."""

from __future__ import annotations

import json

from splitserve.bench.models.trained_model import main


def test_trained_model_bench_writes_its_report(tmp_path):
    out = tmp_path / "trained.md"
    argv = ["--target-preset", "bench", "--target-steps", "2", "--draft-steps", "2", "--max-new-tokens", "3"]
    assert main([*argv, "--fresh", "--out", str(out)]) == 0
    text = out.read_text()
    assert "python -m splitserve.bench.models.trained_model --target-preset bench" in text
    assert "| target (bench) | trained 2 steps |" in text and "| draft (draft) | random |" in text
    assert (tmp_path / "trained_loss.png").stat().st_size > 0
    result = json.loads((tmp_path / "trained.json").read_text())
    assert len(result["training"]["target"]["losses"]) == 2
    for scores in result["scores"].values():
        for kind in ("continue", "quote", "shuffled quote"):
            assert 0.0 <= scores[kind]["hit_rate"] <= 1.0 and 0.0 <= scores[kind]["exact"] <= 1.0
    assert 0.0 <= result["draft_agreement"]["trained"] <= 1.0
