"""Real sliding-window attention, per layer, on checkpoints transformers writes with small
windows: Mistral (every layer windowed), Qwen2 (use_sliding_window, the layers from
max_window_layers on) and Gemma 3 (local layers between global ones). Prompts several windows
long give transformers' logits and greedy tokens through prefill, chunked prefill across the
window, decode across it (batched: the CPU decode plan and the scripted step) and prefix-cache
hits."""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model.loader import load_model
from splitserve.engine.ops import prefill_attention
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.handoff import finish_all, hand_off
from tests.helpers.model import contiguous_metadata, make_kv_cache
from tests.helpers.transformers_checkpoint import (
    SERVABLE_SHAPE,
    TOKENIZER_VOCAB,
    hf_greedy,
    hf_logits,
    write_transformers_checkpoint,
)

pytestmark = pytest.mark.unit

WINDOW = 20  # not a multiple of the block size: windows start and end mid-block
BLOCK_SIZE = 8
SHAPE = {k: v for k, v in SERVABLE_SHAPE.items() if k != "num_hidden_layers"} | {"head_dim": 16}
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**SHAPE, num_hidden_layers=2, sliding_window=WINDOW),
    "qwen2": lambda: transformers.Qwen2Config(
        **SHAPE, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SHAPE,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
    ),
}
# Layer windows as transformers reads each config: Mistral's every layer, Qwen2's from
# max_window_layers (1) on, Gemma 3's local layers.
LAYER_WINDOWS = {"mistral": [WINDOW] * 2, "qwen2": [None, WINDOW, WINDOW], "gemma3": [WINDOW, None, WINDOW]}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf = write_transformers_checkpoint(CONFIGS[name](), path, seed=len(name), tokenizer=True)
    return name, path, hf


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, TOKENIZER_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_windowed_layers_are_the_ones_transformers_windows(checkpoint):
    name, path, _ = checkpoint
    model, config = load_model(path)
    assert [layer.window for layer in model.layers] == LAYER_WINDOWS[name]
    assert config.max_context_len == SHAPE["max_position_embeddings"]  # the window is no cap
    assert config.kv_window == (WINDOW if name == "mistral" else None)


def test_a_prompt_several_windows_long_gives_transformers_logits(checkpoint, monkeypatch):
    """One prefill of 5 windows, in query tiles shorter than the prompt (each against its own
    span of keys), then one cached-prefix chunk: logits within 1e-4 of transformers'."""
    _, path, hf = checkpoint
    monkeypatch.setattr(prefill_attention, "_WINDOW_TILE", 16)
    model, _ = load_model(path)
    ids = _prompt(5 * WINDOW + 3, seed=1)
    expected = hf_logits(hf, ids)
    kv_cache, blocks_per_seq = make_kv_cache(model, len(ids), block_size=BLOCK_SIZE)
    split = 3 * WINDOW + 1  # a chunk reading its window back out of the cache
    rows = []
    for start, end in ((0, split), (split, len(ids))):
        meta = contiguous_metadata([end], [end - start], BLOCK_SIZE, blocks_per_seq)
        hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), kv_cache, meta)
        rows.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(rows), expected, atol=1e-4, rtol=0)


def _engine(path, **overrides) -> LLMEngine:
    config = dict(
        model=str(path),
        block_size=BLOCK_SIZE,
        num_kv_blocks=96,
        max_num_batched_tokens=3 * WINDOW // 2 + 1,  # prompts cross the window in chunks
        enable_prefix_caching=True,
    )
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def test_chunked_prefill_and_batched_decode_across_the_window_give_transformers_tokens(checkpoint):
    """Two prompts of 3 and 4.5 windows, prefilled in chunks smaller than the prompts and
    decoded together (fp32 on CPU: the batched decode plan, the scripted step) for two windows
    more: each gives transformers' greedy tokens. Then a prompt sharing the first one's prefix
    hits the prefix cache and still gives transformers' tokens."""
    _, path, hf = checkpoint
    engine = _engine(path)
    assert engine.runner.scripted_decode is not None  # the decode steps run the scripted graph
    prompts = [_prompt(3 * WINDOW, seed=2), _prompt(9 * WINDOW // 2 + 5, seed=3)]
    params = SamplingParams(max_tokens=2 * WINDOW, temperature=0.0, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 2 * WINDOW)
    shared = prompts[0][: 2 * WINDOW + 4] + _prompt(WINDOW, seed=4)
    (again,) = engine.generate([shared], SamplingParams(max_tokens=WINDOW, temperature=0.0, ignore_eos=True))
    assert again.num_cached_tokens >= 2 * WINDOW
    assert list(again.token_ids) == hf_greedy(hf, shared, WINDOW)
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks  # every block back


def _run_held(engine: LLMEngine, prompt: list[int], max_tokens: int, request_id: str) -> tuple[list[int], list[int]]:
    """Step one request to its end; its tokens, and after each step the blocks it holds (its
    table's entries not skipped), checked against what the pool has handed out."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt_token_ids=prompt, params=params, request_id=request_id)
    seq = engine.scheduler.requests[request_id]
    held, outputs = [], []
    while engine.has_unfinished():
        outputs += engine.step()
        if seq.block_table:
            held.append(len(seq.block_table) - seq.num_skipped_blocks)
            assert engine.config.num_kv_blocks - engine.kv.num_free_blocks == held[-1]
    return list(outputs[-1].token_ids), held


def test_blocks_outside_every_window_are_freed_only_where_every_layer_is_windowed(checkpoint):
    """A prompt of 4 windows decoded for 2 more. Mistral (every layer windowed): the request
    holds about a window's blocks, not its context's; freed blocks keep
    their hashes (evictable), so the same prompt again hits the prefix cache for all of it and
    touches only its window's blocks. Qwen2's and Gemma 3's full-attention layers see every
    position: every block stays. Tokens are transformers' throughout; every block comes back."""
    name, path, hf = checkpoint
    engine = _engine(path)
    prompt = _prompt(4 * WINDOW, seed=6)
    expected = hf_greedy(hf, prompt, 2 * WINDOW)
    tokens, held = _run_held(engine, prompt, 2 * WINDOW, "first")
    assert tokens == expected
    context_blocks = -(-(6 * WINDOW) // BLOCK_SIZE)
    if name != "mistral":
        assert max(held) == context_blocks and engine.kv.window is None
        return
    # After every step (prefill chunks of 31 tokens included): the blocks of the window before
    # its next query, and the one(s) its next tokens go into: 4 of the context's 15.
    decode_window = -(-(WINDOW - 1) // BLOCK_SIZE) + 1
    assert max(held) <= decode_window + 1 < context_blocks
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
    tokens, held = _run_held(engine, prompt, WINDOW, "again")
    assert engine.kv.num_hit_tokens >= 4 * WINDOW - BLOCK_SIZE  # all full prompt blocks but the last
    assert held[0] <= decode_window + 1 and tokens == expected[:WINDOW]
    assert engine.kv.num_free_blocks == engine.config.num_kv_blocks


def test_the_handoff_moves_only_the_blocks_a_window_still_sees(checkpoint):
    """Disaggregated, by hand: the decode engine reserves (and receives) only the prompt
    blocks some query after the prompt sees: for Mistral its last window's, for the models
    with full-attention layers all of them. Tokens are transformers'; both pools come back."""
    name, path, hf = checkpoint
    prefill, decode = _engine(path), _engine(path)
    prompt = _prompt(4 * WINDOW + 3, seed=7)
    params = SamplingParams(max_tokens=WINDOW, temperature=0.0, ignore_eos=True)
    first, indices = hand_off(prefill, decode, prompt, params, "r")
    outputs = {"r": [first]}
    finish_all(decode, outputs)
    assert list(outputs["r"][-1].token_ids) == hf_greedy(hf, prompt, WINDOW)
    num_blocks = -(-len(prompt) // BLOCK_SIZE)
    skipped = (len(prompt) - WINDOW + 1) // BLOCK_SIZE if name == "mistral" else 0
    assert indices == list(range(skipped, num_blocks))
    for engine in (prefill, decode):
        assert engine.kv.num_free_blocks == engine.config.num_kv_blocks
