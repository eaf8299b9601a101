"""Shared helpers for model tests: cached random checkpoints and a minimal paged greedy loop."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from splitserve.engine.builtin_models.make_model import write_random_checkpoint
from splitserve.engine.config import EngineConfig
from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.ops.kv_cache import KVCache

# A test that reads a trained checkpoint of the machine's model cache (cached_checkpoint of a
# ModelSpec with train_steps): all of them run on one xdist worker (tests/conftest.py), since
# the first reader trains it where the cache lacks it and any other would wait on the lock.
READS_TRAINED_CHECKPOINT = pytest.mark.one_worker("trained-checkpoint")


@functools.cache
def _cached_checkpoint(root: str, preset: str, arch: str, items: tuple) -> Path:
    kwargs = dict(items)
    name = "-".join([preset, arch] + [f"{k}={v}" for k, v in items])
    out = Path(root) / name
    if not (out / "config.json").is_file():
        write_random_checkpoint(out, preset=preset, arch=arch, **kwargs)
    return out


def make_checkpoint(tmp_root: str | Path, preset: str = "tiny", arch: str = "llama", **kwargs) -> Path:
    """A random checkpoint under tmp_root, written once per (preset, arch, kwargs) per session.

    Use with a session-scoped tmp dir, e.g. `tmp_path_factory.mktemp("models")`.
    """
    return _cached_checkpoint(str(tmp_root), preset, arch, tuple(sorted(kwargs.items())))


def contiguous_metadata(
    context_lens: list[int],
    query_lens: list[int],
    block_size: int,
    blocks_per_seq: int,
    device: str | torch.device = "cpu",
    block_ranges: list[int] | None = None,
) -> AttentionMetadata:
    """Metadata for sequences that own contiguous block ranges: batch entry i uses blocks
    [r * blocks_per_seq, (r + 1) * blocks_per_seq) with r = block_ranges[i] (default i)."""
    ranges = list(range(len(context_lens))) if block_ranges is None else block_ranges
    slots, starts = [], [0]
    for r, ctx, q in zip(ranges, context_lens, query_lens):
        base = r * blocks_per_seq * block_size
        slots.extend(base + p for p in range(ctx - q, ctx))
        starts.append(starts[-1] + q)
    tables = [[r * blocks_per_seq + b for b in range(blocks_per_seq)] for r in ranges]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        query_start_loc_cpu=starts,
        context_lens_cpu=list(context_lens),
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )


def make_kv_cache(model, max_len: int, num_seqs: int = 1, block_size: int = 16) -> tuple[KVCache, int]:
    """A KV cache with room for num_seqs contiguous sequences of max_len tokens."""
    blocks_per_seq = -(-max_len // block_size)
    engine_config = EngineConfig(
        model="unused",
        block_size=block_size,
        num_kv_blocks=max(2, num_seqs * blocks_per_seq),
        max_num_batched_tokens=max(block_size, max_len * num_seqs),
        device=str(model.device),
    )
    engine_config.dtype = str(model.dtype).removeprefix("torch.")
    return KVCache(model.config, engine_config), blocks_per_seq


def greedy_generate(
    model, prompt_ids: list[int], max_new_tokens: int, block_size: int = 16, eos_token_ids: tuple[int, ...] = ()
) -> list[int]:
    """Prefill once, then decode one token at a time through the paged cache (argmax)."""
    device = model.device
    kv_cache, blocks_per_seq = make_kv_cache(model, len(prompt_ids) + max_new_tokens, 1, block_size)
    tokens = list(prompt_ids)
    new_tokens: list[int] = []
    query = tokens
    while len(new_tokens) < max_new_tokens:
        ctx = len(tokens)
        meta = contiguous_metadata([ctx], [len(query)], block_size, blocks_per_seq, device)
        ids = torch.tensor(query, dtype=torch.int64, device=device)
        positions = torch.arange(ctx - len(query), ctx, dtype=torch.int64, device=device)
        hidden = model(ids, positions, kv_cache, meta)
        next_id = int(model.compute_logits(hidden[-1:]).argmax(-1))
        new_tokens.append(next_id)
        tokens.append(next_id)
        query = [next_id]
        if next_id in eos_token_ids:
            break
    return new_tokens


@contextlib.contextmanager
def single_torch_thread() -> Iterator[None]:
    """One intra-op thread for tiny shapes: they gain nothing from more, and on a shared 2-core
    machine OpenMP barriers make them many times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def engine_reference(model_dir: str | Path, num_kv_blocks: int = 128):
    """expected(prompt ids, max_tokens) -> the greedy token ids of one in-process LLMEngine on
    the checkpoint: what a cluster's output is compared with."""
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.proto.messages.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=num_kv_blocks))

    def expected(prompt: list[int], max_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return engine.generate([prompt], params)[0].token_ids

    return expected
