"""KVSender -> PostedReceive over a real pair (two endpoints in this process): every block layout
(in-place runs, scattered, reversed) and both send modes move exactly the right data, on gloo and
on the same-device channels (ipc: into the receiver's cache in shared memory; host)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.kvtransfer import TransferError
from splitserve.kvtransfer.kv_receiver import PostedReceive
from splitserve.kvtransfer.kv_sender import KVSender, SendJob
from splitserve.kvtransfer.wire_layout import ascending_run_start, plane_messages
from tests.helpers.paired_transports import CHANNEL_OF, SAME_DEVICE, paired_transports

NUM_BLOCKS = 16
TIMEOUT_S = 10.0
LAYOUTS = {  # (prefill block ids, decode block ids)
    "run-to-run": ([3, 4, 5, 6], [9, 10, 11, 12]),
    "scattered-to-run": ([7, 1, 12, 4], [0, 1, 2, 3]),
    "run-to-scattered": ([0, 1, 2, 3], [15, 2, 8, 5]),
    "scattered-to-scattered": ([14, 0, 9, 3], [6, 13, 1, 10]),
    "reversed-to-reversed": ([6, 5, 4, 3], [12, 11, 10, 9]),
    "single-block": ([8], [2]),
}


def _cache(model_dir: str, seed: int | None, shared: bool = False) -> KVCache:
    cache = KVCache(ModelConfig.from_pretrained(model_dir), EngineConfig(model=model_dir, num_kv_blocks=NUM_BLOCKS))
    if seed is not None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    if shared:  # the ipc channel writes into CPU receive buffers in shared memory (harmless elsewhere)
        cache.kv.share_memory_()
    return cache


@pytest.fixture(scope="module", params=SAME_DEVICE, ids=CHANNEL_OF.get)
def pair(request, tiny_model):
    with paired_transports("test", request.param, TIMEOUT_S) as (prefill, decode):
        sender = KVSender(prefill, _cache(tiny_model, seed=1))
        yield sender, decode, tiny_model
        sender.close()


_transfer_ids = itertools.count(1)


def _transfer(pair, src_ids, dst_ids, layerwise, send_per_layer=False):
    sender, decode, model_dir = pair
    target = _cache(model_dir, seed=None, shared=True)
    transfer_id = next(_transfer_ids)
    posted = PostedReceive(decode, target, "test-prefill", transfer_id, dst_ids, layerwise)
    job = SendJob(f"req-{transfer_id}", "test-decode", transfer_id, src_ids, layerwise)
    if send_per_layer:  # how PrefillWorker's layer hook feeds it
        for layer in range(sender.num_layers):
            sender.send_layer(job, layer)
    else:
        sender.send_all(job)
    num_bytes, seconds = posted.complete(TIMEOUT_S)
    assert job.done.result(TIMEOUT_S) is job
    return sender, target, job, num_bytes, seconds


@pytest.mark.parametrize("layerwise", [False, True], ids=["packed", "layerwise"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocks_arrive_intact_and_nothing_else_is_written(pair, layout, layerwise):
    src_ids, dst_ids = LAYOUTS[layout]
    sender, target, job, num_bytes, seconds = _transfer(pair, src_ids, dst_ids, layerwise)
    expected_bytes = len(src_ids) * sender.kv_cache.bytes_per_block
    assert num_bytes == job.num_bytes == expected_bytes and seconds > 0
    assert torch.equal(target.kv[:, :, dst_ids], sender.kv_cache.kv[:, :, src_ids])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert not target.kv[:, :, untouched].any()
    assert not job.pending  # the finished job holds no buffers


def test_layer_by_layer_feed_matches_send_all(pair):
    src_ids, dst_ids = LAYOUTS["scattered-to-run"]
    sender, target, _, _, _ = _transfer(pair, src_ids, dst_ids, layerwise=True, send_per_layer=True)
    assert torch.equal(target.kv[:, :, dst_ids], sender.kv_cache.kv[:, :, src_ids])


def test_concurrent_transfers_on_one_pair_do_not_mix(pair):
    sender, decode, model_dir = pair
    target = _cache(model_dir, seed=None, shared=True)
    cases = [([0, 1], [4, 5], True), ([9, 2], [7, 3], False), ([5, 6, 7], [10, 12, 11], True)]
    posted, jobs = [], []
    for src_ids, dst_ids, layerwise in cases:
        transfer_id = next(_transfer_ids)
        posted.append(PostedReceive(decode, target, "test-prefill", transfer_id, dst_ids, layerwise))
        jobs.append(SendJob(f"req-{transfer_id}", "test-decode", transfer_id, src_ids, layerwise))
    for job in reversed(jobs):  # sent in the opposite order to posting
        sender.send_all(job)
    for receive in posted:
        receive.complete(TIMEOUT_S)
    for src_ids, dst_ids, _ in cases:
        assert torch.equal(target.kv[:, :, dst_ids], sender.kv_cache.kv[:, :, src_ids])


def test_empty_job_completes_without_messages(pair):
    _, _, job, num_bytes, _ = _transfer(pair, [], [], layerwise=True)
    assert num_bytes == job.num_bytes == 0


def test_injected_send_failure_fails_the_job(pair):
    sender, _, _ = pair
    sender.num_sends_to_fail = 1
    job = SendJob("req-fail", "test-decode", next(_transfer_ids), [1, 2], layerwise=False)
    sender.send_all(job)
    with pytest.raises(TransferError, match="injected"):
        job.done.result(TIMEOUT_S)
    assert job.failed


def test_ascending_run_start():
    assert ascending_run_start([4, 5, 6]) == 4
    assert ascending_run_start([9]) == 9
    assert ascending_run_start([]) is None
    assert ascending_run_start([4, 6, 7]) is None
    assert ascending_run_start([6, 5, 4]) is None


def test_plane_messages_are_contiguous_views_of_the_cache():
    planes = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    messages = plane_messages(planes, 2, 4)
    assert [tuple(m.shape) for m in messages] == [(4, 3), (4, 3)]
    assert all(m.is_contiguous() and m.data_ptr() == planes[p, 2].data_ptr() for p, m in enumerate(messages))


@pytest.mark.parametrize(
    "layerwise, num_sent", [(False, 0), (True, 0), (True, 1)], ids=["packed", "layerwise", "layerwise-one-sent"]
)
def test_an_aborted_job_completes_with_filler_and_the_pair_stays_in_step(pair, layerwise, num_sent):
    """A prefill that fails mid-transfer: what was not sent yet goes out as zeros, every posted
    receive completes, and the next transfer on the same pair arrives intact."""
    sender, decode, model_dir = pair
    target = _cache(model_dir, seed=None)
    src_ids, dst_ids = LAYOUTS["scattered-to-scattered"]
    transfer_id = next(_transfer_ids)
    posted = PostedReceive(decode, target, "test-prefill", transfer_id, dst_ids, layerwise)
    job = SendJob(f"req-{transfer_id}", "test-decode", transfer_id, src_ids, layerwise, num_blocks=len(src_ids))
    for layer in range(num_sent):
        sender.send_layer(job, layer)
    deadline = time.monotonic() + TIMEOUT_S
    while job.num_layers_sent < num_sent:  # queued layers still pending when it aborts are filler too
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert sender.abort(job).result(TIMEOUT_S) is True
    posted.complete(TIMEOUT_S)  # every layer arrived: the real ones, then filler
    assert job.num_layers_sent == sender.num_layers and not job.pending
    assert torch.equal(target.kv[:num_sent, :, dst_ids], sender.kv_cache.kv[:num_sent, :, src_ids])
    assert not target.kv[num_sent:].any()
    sender.send_layer(job, 0)  # an aborted job sends nothing more
    _, target, _, _, _ = _transfer(pair, [1, 2], [3, 4], layerwise)
    assert torch.equal(target.kv[:, :, [3, 4]], sender.kv_cache.kv[:, :, [1, 2]])


def test_an_aborted_job_whose_pair_broke_is_not_flushed(pair):
    sender, _, _ = pair
    sender.num_sends_to_fail = 1
    job = SendJob("req-broken", "test-decode", next(_transfer_ids), [1, 2], layerwise=False, num_blocks=2)
    sender.send_all(job)
    with pytest.raises(TransferError):
        job.done.result(TIMEOUT_S)
    assert sender.abort(job).result(TIMEOUT_S) is False


def test_a_job_its_prefill_stopped_waiting_for_is_still_flushed(pair):
    """A prefill call cancelled while it waited for its transfer cancels the job's `done`
    future; aborting the job must still send the filler -- and never end the sender thread
    (it once did, and that replica never sent again)."""
    sender, decode, model_dir = pair
    target = _cache(model_dir, seed=None)
    transfer_id = next(_transfer_ids)
    posted = PostedReceive(decode, target, "test-prefill", transfer_id, [5, 6], True)
    job = SendJob(f"req-{transfer_id}", "test-decode", transfer_id, [1, 2], True, num_blocks=2)
    assert job.done.cancel()  # what asyncio.wait_for(wrap_future(job.done)) does when cancelled
    assert sender.abort(job).result(TIMEOUT_S) is True
    posted.complete(TIMEOUT_S)
    assert not target.kv[:, :, [5, 6]].any()  # filler only
    _, target, _, _, _ = _transfer(pair, [1, 2], [3, 4], True)  # the sender still works
    assert torch.equal(target.kv[:, :, [3, 4]], sender.kv_cache.kv[:, :, [1, 2]])
