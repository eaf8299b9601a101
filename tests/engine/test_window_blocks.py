"""Freeing the KV blocks no layer can see any more (every layer windowed), without a model: the
scheduler and the KV cache manager, torch-free. With the model: tests/engine/test_sliding_window.py."""

from splitserve.engine.core.kv_cache_manager import SKIPPED_BLOCK, KVCacheManager
from splitserve.engine.core.scheduler import Scheduler
from splitserve.engine.core.sequence import Sequence
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.engine.test_scheduler import fake_step

BS, WINDOW, BLOCKS = 4, 10, 32


def make(window: int | None = WINDOW, budget: int = 8):
    kv = KVCacheManager(BLOCKS, BS, enable_caching=True, window=window)
    return kv, Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512)


def held(seq: Sequence) -> list[int]:
    return seq.block_table[seq.num_skipped_blocks :]


def test_a_sequence_past_its_window_holds_only_the_window_and_freed_blocks_stay_cached():
    kv, sched = make()
    seq = Sequence("a", list(range(1, 41)), SamplingParams(max_tokens=20, ignore_eos=True), BS)
    sched.add(seq)
    most = 0
    while seq.num_output_tokens < 19:
        fake_step(sched)
        most = max(most, len(held(seq)))
        # Every freed entry lies wholly before the next query's window.
        assert (seq.num_skipped_blocks * BS) <= max(seq.num_computed_tokens - WINDOW + 1, 0)
        assert BLOCKS - kv.num_free_blocks == len(held(seq))
    # The window's 9 earlier tokens, the next query's block, a chunk of 8: at most 5 of the 15.
    assert most <= -(-(WINDOW - 1 + 8) // BS) + 1 and seq.num_skipped_blocks >= 10
    # Freed blocks went back to the pool with their hashes: still prefix-cache hits.
    seq.update_block_hashes()
    assert all(kv.pool.lookup(h) is not None for h in seq.block_hashes[: seq.num_skipped_blocks])
    fake_step(sched)
    assert seq.is_finished and kv.num_free_blocks == BLOCKS

    # The same prompt again: a hit for all its full blocks but the last (its last token must
    # run), and the ones before its first query's window are not even touched.
    again = Sequence("b", list(range(1, 41)), SamplingParams(max_tokens=2, ignore_eos=True), BS)
    cached = kv.find_cached_blocks(again)
    assert kv.allocate_prompt(again, cached, again.num_tokens - len(cached) * BS)
    skipped = (36 - WINDOW + 1) // BS
    assert len(cached) == 9 and again.num_skipped_blocks == skipped == 6
    assert again.block_table[:skipped] == [SKIPPED_BLOCK] * skipped and held(again)[:3] == cached[skipped:]
    assert all(kv.pool.ref_counts[b] == 0 for b in cached[:skipped])
    kv.free(again)
    assert kv.num_free_blocks == BLOCKS


def test_a_reservation_skips_the_prompt_blocks_no_query_after_it_sees():
    """The decode side of the handoff: its first query is past the prompt, so only the
    blocks of the prompt's last window are reserved (and received)."""
    kv, _ = make()
    seq = Sequence("r", list(range(1, 31)), SamplingParams(max_tokens=4), BS)  # 8 blocks, last partial
    assert kv.allocate_prompt(seq, [], seq.num_prompt_tokens, next_query=seq.num_prompt_tokens)
    skipped = (30 - WINDOW + 1) // BS
    assert seq.num_skipped_blocks == skipped == 5 and len(held(seq)) == 8 - skipped
    assert BLOCKS - kv.num_free_blocks == 3
    kv.free(seq)
    assert kv.num_free_blocks == BLOCKS and seq.num_skipped_blocks == 0


def test_preemption_frees_what_is_held_and_the_recompute_hits_the_cache():
    kv, sched = make(budget=64)
    seq = Sequence("p", list(range(1, 33)), SamplingParams(max_tokens=30, ignore_eos=True), BS)
    sched.add(seq)
    for _ in range(8):
        fake_step(sched)
    assert seq.num_skipped_blocks > 0
    sched._preempt(sched.running.pop())
    assert kv.num_free_blocks == BLOCKS and seq.block_table == []
    batch = fake_step(sched)  # readmitted: its prefix (freed blocks included, still cached) is a hit
    assert batch.num_new_tokens == [seq.num_tokens - 1 - 36] and seq.num_skipped_blocks > 0
    while sched.has_unfinished():
        fake_step(sched)
    assert kv.num_free_blocks == BLOCKS


def test_without_a_window_nothing_is_freed_early():
    kv, sched = make(window=None)
    seq = Sequence("f", list(range(1, 41)), SamplingParams(max_tokens=8, ignore_eos=True), BS)
    sched.add(seq)
    while seq.num_output_tokens < 7:
        fake_step(sched)
    assert seq.num_skipped_blocks == 0 and len(held(seq)) == -(-seq.num_tokens // BS)
