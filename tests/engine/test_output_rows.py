"""The last layer computes only the rows a step reads out (LlamaForCausalLM.forward's
output_rows, engine/ops/attention_metadata.py's OutputRows): those rows' hidden states are the
full forward's, every row's K/V lands in the cache bitwise as before, and the engine's runner
takes the path for a prefill but not where every row is read (prompt log-probabilities)."""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve.engine.model.loader import load_model
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.engine.test_engine import assert_baseline, engine_for, hf_greedy
from tests.helpers.model import contiguous_metadata, make_checkpoint, make_kv_cache
from tests.helpers.transformers_checkpoint import PARITY_SHAPE, write_transformers_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 16
WINDOW = 12  # the windowed model's: shorter than the chunk and the prefix below


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def _model_dir(models_root, case: str):
    if case == "mistral-window":  # every layer windowed: the rows attend through the window
        config = transformers.MistralConfig(**PARITY_SHAPE, sliding_window=WINDOW)
        path = models_root / case
        if not path.exists():
            write_transformers_checkpoint(config, path, seed=3)
        return path
    return make_checkpoint(models_root, "tiny", case, seed=11)


def _run_steps(model, output_rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 prefills a 40-token prefix (seq 0) and 19 tokens of seq 2. Step 2 is mixed: seq
    0's 25-token chunk behind its cached prefix, seq 1's fresh 33-token prompt, seq 2's decode
    token. Returns (step 2's hidden states, the KV cache after it)."""
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (40 + 25 + 33 + 20,), generator=torch.Generator().manual_seed(5)).tolist()
    seq0, seq1, seq2 = tokens[:65], tokens[65:98], tokens[98:]
    kv_cache, per_seq = make_kv_cache(model, 80, num_seqs=3, block_size=BLOCK_SIZE)
    meta = contiguous_metadata([40, 19], [40, 19], BLOCK_SIZE, per_seq, block_ranges=[0, 2])
    model(torch.tensor(seq0[:40] + seq2[:19]), torch.tensor([*range(40), *range(19)]), kv_cache, meta)
    meta = contiguous_metadata([65, 33, 20], [25, 33, 1], BLOCK_SIZE, per_seq)
    positions = torch.tensor([*range(40, 65), *range(33), 19])
    extra = {} if output_rows is None else {"output_rows": output_rows}
    hidden = model(torch.tensor(seq0[40:] + seq1 + seq2[19:]), positions, kv_cache, meta, **extra)
    return hidden, kv_cache.kv.clone()


@pytest.mark.parametrize("case", ["llama", "qwen3", "gemma3", "mistral-window"])
def test_output_rows_are_the_full_forwards_rows_with_the_same_kv(models_root, case):
    model, _ = load_model(_model_dir(models_root, case))
    full, full_kv = _run_steps(model, None)
    # Each sequence's last row (a chunk, a fresh prompt, a decode), out of batch order, and
    # several rows of one sequence (as a speculative step verifies its draft).
    rows = [57, 20, 21, 22, 24, 58]
    part, part_kv = _run_steps(model, rows)
    assert part.shape == (len(rows), full.shape[1])
    # Not bitwise: a row attends as a decode query, summing its keys in another order than
    # the prefill kernel (the matmuls give each row the same bits whatever the row count).
    torch.testing.assert_close(part, full[rows], atol=1e-4, rtol=1e-4)
    assert torch.equal(part_kv, full_kv)  # every row's K/V, every layer: bitwise the same
    # A chunk that samples nothing: no row goes on past the last layer's K/V.
    none, none_kv = _run_steps(model, [])
    assert none.shape == (0, full.shape[1])
    assert torch.equal(none_kv, full_kv)


def test_the_runner_reads_out_rows_for_a_prefill_but_not_for_prompt_logprobs(models_root, monkeypatch):
    """Through the engine: a prompt's prefill passes its sampled row only, and still gives
    transformers' greedy tokens; a request for prompt log-probabilities passes none (every row
    is read); a decode step of every row passes none (nothing to skip: the scripted step)."""
    path = _model_dir(models_root, "llama")
    engine = engine_for(path, max_num_batched_tokens=64)
    seen: list[tuple[int, list[int] | None]] = []
    forward = type(engine.model).forward

    def spy(model, input_ids, *args, **kwargs):
        seen.append((input_ids.shape[0], kwargs.get("output_rows")))
        return forward(model, input_ids, *args, **kwargs)

    monkeypatch.setattr(type(engine.model), "forward", spy)
    prompt = list(range(3, 103))  # 100 tokens: chunks of 64 and 36 under the step budget
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out.token_ids == hf_greedy(path, prompt, 4)
    assert seen[:2] == [(64, []), (36, [35])]  # the first chunk samples nothing
    assert all(rows is None for _, rows in seen[2:])  # one-row decode steps: all rows read
    seen.clear()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=1)
    (out,) = engine.generate([list(range(200, 230))], params)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 29  # every position but the first
    assert seen == [(30, None)]
    assert_baseline(engine)
