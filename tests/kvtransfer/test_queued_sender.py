"""QueuedSender's shared queue loop and chaos faults, on the simulated sender (no torch, no
pair): jobs go out in queue order, a stall holds every send until the fault is switched off
(switching it off wakes a stalled send at once), a failed send fails its job and only it, and
an aborted job is flushed."""

from __future__ import annotations

import threading

import pytest

from splitserve.engine.simulated.simulated_kv_cache import SimulatedKVCache
from splitserve.engine.simulated.step_time_profile import KVLinkProfile, StepTimeProfile
from splitserve.kvtransfer.errors import TransferError
from splitserve.kvtransfer.send_job import SendJob
from splitserve.kvtransfer.simulated_kv_sender import SimulatedKVSender

NUM_LAYERS = 4
WAIT_S = 30  # a safety net only


@pytest.fixture
def sender():
    profile = StepTimeProfile(name="t", step_overhead_s=0, token_compute_s=0, kv_link=KVLinkProfile(bytes_per_s=1e12))
    sender = SimulatedKVSender(SimulatedKVCache(NUM_LAYERS, 16, 1024, profile))
    yield sender
    sender.close()


def job(name: str, layerwise: bool = False) -> SendJob:
    return SendJob(name, "decode-0", 1, [0, 1, 2], layerwise, num_blocks=3)


def test_jobs_complete_in_queue_order_layer_by_layer_or_whole(sender):
    finished: list[str] = []
    jobs = [job("whole"), job("layerwise", layerwise=True)]
    for j in jobs:
        j.done.add_done_callback(lambda _f, name=j.request_id: finished.append(name))
    sender.send_all(jobs[0])
    for layer in range(NUM_LAYERS):
        sender.send_layer(jobs[1], layer)
    assert [j.done.result(WAIT_S).num_layers_sent for j in jobs] == [NUM_LAYERS, NUM_LAYERS]
    assert finished == ["whole", "layerwise"]
    assert sender.total_bytes == 2 * 3 * 1024 == sum(j.num_bytes for j in jobs)


def test_switching_a_stall_off_wakes_the_stalled_send(sender):
    sender.stall_s = 3600.0  # longer than any test: only switching it off ends it
    stalled = job("stalled")
    sender.send_all(stalled)
    woken = threading.Event()
    stalled.done.add_done_callback(lambda _f: woken.set())
    assert not stalled.done.done()
    sender.stall_s = 0.0
    assert woken.wait(WAIT_S) and stalled.done.result().num_layers_sent == NUM_LAYERS


def test_a_job_given_up_during_a_stall_is_not_sent(sender):
    sender.stall_s = 3600.0
    given_up, after = job("given-up"), job("after")
    sender.send_all(given_up)
    sender.send_all(after)
    given_up.done.cancel()  # its lease ran out: its blocks may be reused
    sender.stall_s = 0.0
    after.done.result(WAIT_S)
    assert given_up.num_layers_sent == 0 and given_up.num_bytes == 0


def test_an_injected_failure_fails_that_job_only(sender):
    sender.num_sends_to_fail = 1
    failed, ok = job("failed"), job("ok")
    sender.send_all(failed)
    sender.send_all(ok)
    with pytest.raises(TransferError, match="injected send failure for failed"):
        failed.done.result(WAIT_S)
    assert ok.done.result(WAIT_S).num_layers_sent == NUM_LAYERS and failed.failed


def test_an_aborted_job_is_flushed_and_a_failed_one_is_not(sender):
    aborted = job("aborted", layerwise=True)
    sender.send_layer(aborted, 0)
    assert sender.abort(aborted).result(WAIT_S) is True
    assert not aborted.done.done()  # its remaining layers were never sent
    sender.num_sends_to_fail = 1
    broken = job("broken")
    sender.send_all(broken)
    with pytest.raises(TransferError):
        broken.done.result(WAIT_S)
    assert sender.abort(broken).result(WAIT_S) is False
