"""kvtransfer.KVTransport over gloo on 127.0.0.1: this process is one endpoint, a child the other."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from splitserve.bench.kv_transfer.raw_bandwidth import measure_gloo_bandwidth
from splitserve.kvtransfer import KVTransport, TransferError, TransportUsageError, resolve_host
from tests.helpers import transport as helpers
from tests.helpers.block_transfer import recv_blocks, send_blocks

# A safety net for the transfers that must succeed, not a bound on how long they take: a busy
# machine can hold a peer off its core for seconds. Tests of a timeout pass their own.
PEER_TIMEOUT_S = 60.0
KV_MESSAGE = [([2, 2, 4, 8], "float32", 1), ([3, 5], "bfloat16", 2), ([7], "int64", 3)]
BLOCK_MESSAGE = [([2, 16, 2, 8], "float16", 4)]


def _start_peer(endpoint_id: str) -> helpers.PeerProcess:
    peer = helpers.PeerProcess()
    try:
        peer.call("init", endpoint_id=endpoint_id, timeout_s=PEER_TIMEOUT_S)
    except BaseException:
        peer.kill()
        raise
    return peer


@pytest.fixture(scope="module")
def shared_peer():
    """One child endpoint for the tests that leave it alive (each child costs a torch import).

    Tests talk to it from uniquely named local endpoints, so its stale pairs never collide.
    """
    peer = _start_peer("peer-shared")
    yield peer
    peer.kill()


@pytest.fixture
def spawn_peer():
    """Start child endpoints that a test may kill (all killed at teardown)."""
    started = []

    def spawn(endpoint_id: str) -> helpers.PeerProcess:
        started.append(_start_peer(endpoint_id))
        return started[-1]

    yield spawn
    for peer in started:
        peer.kill()


@pytest.fixture
def local():
    transports = []

    def make(endpoint_id: str, timeout_s: float = PEER_TIMEOUT_S) -> KVTransport:
        transports.append(KVTransport(endpoint_id, "cpu", timeout_s=timeout_s))
        return transports[-1]

    yield make
    for transport in transports:
        transport.close()


def _open_as_sender(sender: KVTransport, peer: helpers.PeerProcess, peer_id: str, epoch: int) -> None:
    peer.post("open", peer_id=sender.endpoint_id, address=list(sender.address), role="receiver", epoch=epoch)
    sender.open_pair(peer_id, None, "sender", epoch)
    assert "error" not in peer.reply()


def _open_as_receiver(receiver: KVTransport, peer: helpers.PeerProcess, peer_id: str, epoch: int) -> None:
    address = tuple(peer.call("address")["address"])
    peer.post("open", peer_id=receiver.endpoint_id, address=None, role="sender", epoch=epoch)
    receiver.open_pair(peer_id, address, "receiver", epoch)
    assert "error" not in peer.reply()


def _send_checked(sender: KVTransport, peer: helpers.PeerProcess, peer_id: str, specs, tag: int) -> None:
    peer.post("recv", peer_id=sender.endpoint_id, specs=specs, tag=tag)
    sent = sender.send(peer_id, [helpers.make_tensor(*spec) for spec in specs], tag)
    received = peer.reply()
    assert received.get("match") is True, received
    assert sent == received["bytes"] == helpers.spec_bytes(specs)


def test_lazy_open_then_tagged_transfers_arrive_intact_and_are_counted(local, shared_peer):
    prefill = local("prefill-tags")
    before = shared_peer.call("stats")
    assert prefill.peers() == []
    _open_as_sender(prefill, shared_peer, "peer-shared", epoch=0)
    assert prefill.peers() == ["peer-shared"]

    _send_checked(prefill, shared_peer, "peer-shared", KV_MESSAGE, tag=1)
    _send_checked(prefill, shared_peer, "peer-shared", BLOCK_MESSAGE, tag=2)
    _send_checked(prefill, shared_peer, "peer-shared", KV_MESSAGE, tag=1)

    expected_bytes = 2 * helpers.spec_bytes(KV_MESSAGE) + helpers.spec_bytes(BLOCK_MESSAGE)
    stats = prefill.stats()
    assert (stats.bytes_sent, stats.num_sends, stats.bytes_received) == (expected_bytes, 3, 0)
    assert stats.seconds_sending > 0 and stats.num_pairs_opened == 1
    after = shared_peer.call("stats")
    assert after["bytes_received"] - before["bytes_received"] == expected_bytes
    assert after["num_recvs"] - before["num_recvs"] == 3


def test_recv_times_out_when_the_sender_never_sends(local, shared_peer):
    decode = local("decode-timeout")
    _open_as_receiver(decode, shared_peer, "peer-shared", epoch=0)
    started = time.monotonic()
    with pytest.raises(TransferError, match="recv") as err:
        decode.recv("peer-shared", [torch.empty(16)], tag=5, timeout_s=1.0)
    assert time.monotonic() - started >= 0.9
    # It waited the call's 1 s, not the endpoint's PEER_TIMEOUT_S (gloo names the wait it timed out).
    waited_ms = re.search(r"Timed out waiting (\d+)ms", str(err.value))
    assert waited_ms and int(waited_ms.group(1)) <= 1000, err.value
    assert not decode.has_pair("peer-shared")  # a failed pair is out of sync: it is closed
    assert decode.stats().num_failures == 1


def test_killed_peer_fails_the_other_side_fast_and_a_restart_reopens_with_a_new_epoch(local, spawn_peer):
    prefill, decode = local("prefill-kill"), local("decode-kill")
    peer = spawn_peer("peer-kill")
    _open_as_sender(prefill, peer, "peer-kill", epoch=0)
    _send_checked(prefill, peer, "peer-kill", BLOCK_MESSAGE, tag=3)

    # Sender side: the peer never posts a recv, so the 16 MB send is in flight when it dies.
    threading.Timer(0.5, peer.kill).start()
    with pytest.raises(TransferError) as err:
        prefill.send("peer-kill", [torch.ones(4 << 20)], tag=3, timeout_s=10.0)
    assert "Timed out" not in str(err.value)  # it failed on the death, not at its timeout
    assert prefill.peers() == []

    restarted = spawn_peer("peer-kill")
    _open_as_sender(prefill, restarted, "peer-kill", epoch=1)
    _send_checked(prefill, restarted, "peer-kill", KV_MESSAGE, tag=3)
    stats = prefill.stats()  # counters survive the dead pair
    assert stats.num_pairs_opened == 2 and stats.num_failures == 1 and stats.num_sends == 2

    # Receiver side: this endpoint waits in recv when its sender dies.
    _open_as_receiver(decode, restarted, "peer-kill", epoch=0)
    threading.Timer(0.5, restarted.kill).start()
    with pytest.raises(TransferError) as err:
        decode.recv("peer-kill", [torch.empty(1 << 20)], tag=1, timeout_s=10.0)
    assert "Timed out" not in str(err.value)
    assert decode.peers() == []


def test_close_idle_tears_down_idle_pairs_and_the_peer_notices(local, shared_peer):
    decode = local("decode-idle")
    _open_as_receiver(decode, shared_peer, "peer-shared", epoch=0)
    shared_peer.post("send", peer_id="decode-idle", specs=BLOCK_MESSAGE, tag=1)
    buffer = torch.empty(2, 16, 2, 8, dtype=torch.float16)
    decode.recv("peer-shared", [buffer], tag=1)
    assert shared_peer.reply()["bytes"] == buffer.nbytes

    assert decode.close_idle(max_idle_s=30.0) == []
    time.sleep(0.3)
    assert decode.close_idle(max_idle_s=0.2) == ["peer-shared"]
    assert decode.peers() == []
    with pytest.raises(TransferError, match="no open pair"):
        decode.recv("peer-shared", [buffer], tag=1, timeout_s=0.5)

    assert "decode-idle" in shared_peer.call("peers")["peers"]  # the sender learns on its next op
    shared_peer.post("send", peer_id="decode-idle", specs=BLOCK_MESSAGE, tag=1, timeout_s=3.0)
    result = shared_peer.reply()
    assert result.get("transfer_error") is True and "Timed out" not in result["error"], result
    assert "decode-idle" not in shared_peer.call("peers")["peers"]

    _open_as_receiver(decode, shared_peer, "peer-shared", epoch=1)
    shared_peer.post("send", peer_id="decode-idle", specs=BLOCK_MESSAGE, tag=1)
    decode.recv("peer-shared", [buffer], tag=1)
    assert torch.equal(buffer, helpers.make_tensor(*BLOCK_MESSAGE[0]))
    assert "error" not in shared_peer.reply()


def test_open_pair_times_out_when_the_peer_never_joins(local):
    prefill = local("prefill-0", timeout_s=1.0)
    with pytest.raises(TransferError, match=r"did not join within 1\.0s"):  # the endpoint's timeout
        prefill.open_pair("decode-9", None, "sender", epoch=0)

    decode = local("decode-9", timeout_s=1.0)
    unused_port = KVTransport("probe", "cpu").address[1]  # its server is gone once collected
    with pytest.raises(TransferError, match="no store is listening"):  # refused at once, no wait
        decode.open_pair("prefill-0", ("127.0.0.1", unused_port), "receiver", epoch=0, timeout_s=1.0)


def test_pairs_in_one_process_run_concurrently_from_threads(local):
    prefill = local("prefill-0")
    receivers = {name: local(name) for name in ("decode-0", "decode-1")}
    openers = [threading.Thread(target=prefill.open_pair, args=(name, None, "sender", 0)) for name in receivers]
    for thread in openers:
        thread.start()
    for receiver in receivers.values():
        receiver.open_pair("prefill-0", prefill.address, "receiver", 0)
    for thread in openers:
        thread.join(timeout=10)
    assert prefill.peers() == ["decode-0", "decode-1"]

    payloads = {name: torch.full((1 << 16,), float(i)) for i, name in enumerate(receivers)}
    senders = [threading.Thread(target=prefill.send, args=(name, [payloads[name]], 9)) for name in receivers]
    for thread in senders:
        thread.start()
    for name, receiver in receivers.items():
        buffer = torch.empty(1 << 16)
        receiver.recv("prefill-0", [buffer], tag=9)
        assert torch.equal(buffer, payloads[name])
    for thread in senders:
        thread.join(timeout=10)
    assert prefill.stats().bytes_sent == 2 * payloads["decode-0"].nbytes


def test_reopening_the_same_epoch_reuses_the_pair_and_bad_calls_are_rejected(local):
    prefill, decode = local("prefill-0"), local("decode-0")
    opener = threading.Thread(target=prefill.open_pair, args=("decode-0", None, "sender", 0))
    opener.start()
    pair = decode.open_pair("prefill-0", prefill.address, "receiver", 0)
    opener.join(timeout=10)
    assert decode.open_pair("prefill-0", prefill.address, "receiver", 0) is pair

    with pytest.raises(TransportUsageError, match="not contiguous"):
        prefill.send("decode-0", [torch.zeros(4, 4).t()], tag=1)
    with pytest.raises(TransportUsageError, match="tag"):
        prefill.send("decode-0", [torch.zeros(4)], tag=-1)
    with pytest.raises(TransportUsageError, match="list"):
        prefill.send("decode-0", torch.zeros(4), tag=1)
    with pytest.raises(TransportUsageError, match="timeout_s"):
        prefill.send("decode-0", [torch.zeros(4)], tag=1, timeout_s=1e6)
    with pytest.raises(TransportUsageError, match="address"):
        decode.open_pair("prefill-1", None, "receiver", 0)
    with pytest.raises(TransportUsageError, match="role"):
        decode.open_pair("prefill-1", None, "observer", 0)
    with pytest.raises(TransportUsageError, match="endpoint_id"):
        KVTransport("a->b", "cpu")
    with pytest.raises(TransferError, match="no open pair"):
        prefill.send("decode-7", [torch.zeros(4)], tag=1)
    assert prefill.stats().num_failures == 0

    decode.close()
    with pytest.raises(TransferError, match="closed"):
        decode.recv("prefill-0", [torch.zeros(4)], tag=1)


def _open_local_pair(prefill: KVTransport, decode: KVTransport, epoch: int = 0) -> None:
    opener = threading.Thread(target=prefill.open_pair, args=(decode.endpoint_id, None, "sender", epoch))
    opener.start()
    decode.open_pair(prefill.endpoint_id, prefill.address, "receiver", epoch)
    opener.join(timeout=10)
    assert prefill.has_pair(decode.endpoint_id)


def test_receives_posted_early_complete_in_any_send_order(local):
    prefill, decode = local("prefill-early"), local("decode-early")
    _open_local_pair(prefill, decode)
    buffers = {tag: torch.empty(1000) for tag in (11, 12, 13)}
    ops = {tag: decode.irecv("prefill-early", [buffers[tag]], tag) for tag in buffers}
    assert not any(op.settled for op in ops.values())
    assert decode.close_idle(max_idle_s=0.0) == []  # pending receives keep the pair open

    def send_in_reverse():
        for tag in sorted(buffers, reverse=True):
            prefill.send("decode-early", [torch.full((1000,), float(tag))], tag)

    sender = threading.Thread(target=send_in_reverse)
    sender.start()
    for tag, op in ops.items():
        assert op.wait(5.0) == 4000 and op.settled
        assert torch.equal(buffers[tag], torch.full((1000,), float(tag)))
        assert op.wait(0.1) == 4000  # waiting again returns the same result
    sender.join(timeout=10)
    assert decode.stats().num_recvs == 3 and prefill.stats().num_sends == 3


def test_closing_a_pair_fails_its_pending_ops_promptly_on_both_sides(local):
    prefill, decode = local("prefill-close"), local("decode-close")
    _open_local_pair(prefill, decode)
    pending_recv = decode.irecv("prefill-close", [torch.empty(64)], tag=1)
    pending_send = prefill.isend("decode-close", [torch.ones(64)], tag=2)  # never received
    outcomes = {}

    def wait(name, op):
        try:
            op.wait(10.0)
            outcomes[name] = "completed"
        except TransferError as exc:
            outcomes[name] = str(exc)

    waiters = [threading.Thread(target=wait, args=item) for item in (("recv", pending_recv), ("send", pending_send))]
    for thread in waiters:
        thread.start()
    time.sleep(0.3)
    assert decode.close_pair("prefill-close") is True
    for thread in waiters:
        thread.join(timeout=10)
    assert set(outcomes) == {"recv", "send"}
    # Both failed on the close, not at their 10 s timeout.
    assert all(outcome != "completed" and "Timed out" not in outcome for outcome in outcomes.values()), outcomes
    assert decode.peers() == [] and prefill.peers() == []
    assert decode.close_pair("prefill-close") is False


def test_paged_blocks_move_between_different_block_ids(local):
    prefill, decode = local("prefill-blocks"), local("decode-blocks")
    _open_local_pair(prefill, decode)
    # kv[layer, K|V, block, offset, kv_head, head_dim], as engine.kv_cache.KVCache lays it out.
    source = torch.randn(2, 2, 6, 4, 2, 8, dtype=torch.bfloat16)
    target = torch.zeros(2, 2, 9, 4, 2, 8, dtype=torch.bfloat16)
    sender = threading.Thread(
        target=send_blocks, args=(prefill, "decode-blocks", source[1].view(2, 6, -1), [5, 0, 3], 4)
    )
    sender.start()
    num_bytes = recv_blocks(decode, "prefill-blocks", target[1].view(2, 9, -1), torch.tensor([1, 8, 2]), 4)
    sender.join(timeout=10)
    assert num_bytes == 2 * 3 * 4 * 2 * 8 * 2
    assert torch.equal(target[1][:, [1, 8, 2]], source[1][:, [5, 0, 3]])
    assert torch.count_nonzero(target[0]) == 0 and torch.count_nonzero(target[1][:, [0, 3, 4, 5, 6, 7]]) == 0


def test_resolve_host_passes_addresses_through_and_finds_this_node_for_auto():
    assert resolve_host("127.0.0.1") == "127.0.0.1"
    node_ip = resolve_host("auto")
    assert len(node_ip.split(".")) == 4 and all(part.isdigit() for part in node_ip.split("."))
    with pytest.raises(TransportUsageError):
        resolve_host("")


@pytest.mark.slow  # spawns two fresh interpreters
def test_raw_gloo_bandwidth_reports_a_positive_rate():
    result = measure_gloo_bandwidth(1 << 20, num_iters=2)
    assert result["num_bytes"] == 1 << 20 and result["bytes_per_s"] > 0
