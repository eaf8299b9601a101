"""The quote workload: corpus quotes and their cue, seeded, in the served model's tokenizer."""

from __future__ import annotations

import pytest

from splitserve.bench.loadgen.quote_workload import QuoteWorkload
from splitserve.bench.loadgen.records import WorkloadError


def test_quote_prompts_repeat_their_cue(tiny_model):
    from tokenizers import Tokenizer

    workload = QuoteWorkload(tiny_model, num_requests=6, quote_len=24, cue_len=4, max_tokens=32)
    requests = workload.generate(seed=1)
    assert requests == workload.generate(seed=1) and requests != workload.generate(seed=2)
    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    separator = tok.encode("\n\n", add_special_tokens=False).ids
    for r in requests:
        ids = list(r.prompt_token_ids)
        quote = ids[1:25]
        assert ids[0] == tok.token_to_id("<s>") and ids[25:] == separator + quote[:4]
        assert r.max_tokens == 32
    assert len({r.prompt_token_ids for r in requests}) > 1
    assert workload.describe()["kind"] == "quote"


def test_quote_workload_refuses_bad_settings(tmp_path):
    with pytest.raises(WorkloadError, match="cue_len"):
        QuoteWorkload("x", quote_len=4, cue_len=8)
    with pytest.raises(WorkloadError, match="--tokenizer"):
        QuoteWorkload(str(tmp_path)).generate(0)
