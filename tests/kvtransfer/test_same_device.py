"""Same-device pairs (splitserve.kvtransfer.kv_channel): the channel choice, and the `ipc` and `host`
channels between two real processes on this host (CPU shared memory runs the same protocol that
CUDA IPC runs on one GPU), including the fallback from ipc to host when sharing fails."""

from __future__ import annotations

import threading

import pytest
import torch

from splitserve.kvtransfer import KVTransport, TransferError, TransportUsageError
from splitserve.kvtransfer.kv_channel import DeviceIdentity, choose_channel, local_identity
from tests.helpers import transport as helpers

# One worker runs this file: its three child processes (the `children` fixture) start once.
pytestmark = pytest.mark.one_worker

# A safety net for the transfers that must succeed, not a bound on how long they take: a busy
# machine can hold a peer off its core for seconds. Tests of a timeout pass their own.
PEER_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 120.0
MESSAGE = [([2, 3, 4], "float32", 11), ([5], "bfloat16", 12), ([3, 2], "int64", 13)]


def _identity(device: str, host: str = "node-a", mode: str = "auto") -> DeviceIdentity:
    return DeviceIdentity(host, "cpu" if device == "cpu" else "cuda", device, mode)


@pytest.mark.parametrize(
    "sender,receiver,channel",
    [
        (_identity("cpu"), _identity("cpu"), "gloo"),
        (_identity("cpu"), _identity("cpu", host="node-b"), "gloo"),
        (_identity("cpu", mode="ipc"), _identity("cpu"), "ipc"),
        (_identity("cpu", mode="host"), _identity("cpu"), "host"),
        (_identity("GPU-1"), _identity("GPU-2"), "nccl"),
        (_identity("GPU-1"), _identity("GPU-1", host="node-b"), "nccl"),
        (_identity("GPU-1"), _identity("GPU-1"), "ipc"),
        (_identity("GPU-1", mode="ipc"), _identity("GPU-1"), "ipc"),
        (_identity("GPU-1", mode="host"), _identity("GPU-1", mode="ipc"), "host"),  # the sender decides
        (_identity("GPU-1", mode="host"), _identity("GPU-2"), "nccl"),
    ],
)
def test_channel_choice(sender, receiver, channel):
    assert choose_channel(sender, receiver) == channel


def test_channel_choice_rejects_bad_identities_and_modes():
    with pytest.raises(TransferError, match="same kind of device"):
        choose_channel(_identity("cpu"), _identity("GPU-1"))
    with pytest.raises(TransportUsageError, match="same_device must be one of"):
        _identity("cpu", mode="nccl")
    with pytest.raises(TransferError, match="unreadable device identity"):
        DeviceIdentity.from_json(b"{not json")
    with pytest.raises(TransportUsageError, match="same_device must be one of"):
        KVTransport("x", "cpu", same_device="shm")
    identity = local_identity(torch.device("cpu"), "ipc")
    assert DeviceIdentity.from_json(identity.to_json()) == identity and identity.device == "cpu"


def _start(started: list, count: int) -> list[helpers.PeerProcess]:
    """Child processes (each will be one endpoint), started together so their torch imports
    overlap; waits until each answers."""
    peers = [helpers.PeerProcess() for _ in range(count)]
    started.extend(peers)
    for peer in peers:  # importing torch in several processes at once is slow on a loaded box
        peer.post("ping")
        assert "error" not in peer.reply(timeout_s=STARTUP_TIMEOUT_S)
    return peers


def _init(peers: list[helpers.PeerProcess], endpoints: dict[str, dict]) -> list[helpers.PeerProcess]:
    """Make the first len(endpoints) children fresh endpoints: {endpoint_id: init args}. The
    sharing strategy is set every time (default torch's 'file_descriptor'): it is per process."""
    for peer, (endpoint_id, init) in zip(peers, endpoints.items()):
        init = {"sharing_strategy": "file_descriptor", **init}
        peer.call("init", endpoint_id=endpoint_id, timeout_s=PEER_TIMEOUT_S, **init)
    return peers[: len(endpoints)]


@pytest.fixture(scope="module")
def children():
    """Three children shared by the tests that leave them alive; each test re-initialises them."""
    started: list[helpers.PeerProcess] = []
    yield _start(started, 3)
    for peer in started:
        peer.kill()


@pytest.fixture
def ipc_pair(children):
    """An open ipc pair between two children (CPU shared memory: the 'file_system' strategy)."""
    shared = {"sharing_strategy": "file_system"}
    sender, receiver = _init(children, {"sender": {"same_device": "ipc", **shared}, "receiver": shared})
    return sender, receiver, _connect(sender, receiver)


def _connect(
    sender: helpers.PeerProcess, receiver: helpers.PeerProcess, epoch: int = 0, sender_id: str = "sender"
) -> tuple[dict, dict]:
    """Open the pair on both processes at once; returns each side's open reply."""
    address = sender.call("address")["address"]
    receiver.post("open", peer_id=sender_id, address=address, role="receiver", epoch=epoch)
    opened_sender = sender.call("open", peer_id="receiver", address=None, role="sender", epoch=epoch)
    opened_receiver = receiver.reply()
    assert "error" not in opened_receiver, opened_receiver
    return opened_sender, opened_receiver


def test_ipc_channel_copies_into_the_receivers_shared_buffers_in_posting_order(ipc_pair):
    sender, receiver, opened = ipc_pair
    assert [o["channel"] for o in opened] == ["ipc", "ipc"]
    # Two receives on one tag and one on another, all posted before any send.
    first, second, other = MESSAGE[:1], MESSAGE[1:2], MESSAGE[2:]
    for name, specs, tag in (("a", first, 5), ("b", second, 5), ("c", other, 6)):
        receiver.call("irecv", name=name, peer_id="sender", specs=specs, tag=tag, shared=True)
    for name, specs, tag in (("c", other, 6), ("a", first, 5), ("b", second, 5)):
        sender.call("isend", name=name, peer_id="receiver", specs=specs, tag=tag)
    # The sender waits on the later op of tag 5 first: the earlier one still fills the first receive.
    for name in ("b", "c", "a"):
        assert sender.call("wait", name=name)["bytes"] > 0
    for name, specs in (("c", other), ("b", second), ("a", first)):
        result = receiver.call("wait", name=name)
        assert result["match"] and result["bytes"] == helpers.spec_bytes(specs), name
    # Blocking calls, many tensors in one call, both directions of the same processes' pair.
    receiver.post("recv", peer_id="sender", specs=MESSAGE, tag=7, shared=True)
    assert sender.call("send", peer_id="receiver", specs=MESSAGE, tag=7)["bytes"] == helpers.spec_bytes(MESSAGE)
    assert receiver.reply()["match"]


def test_ipc_channel_receives_into_buffers_outside_shared_memory_through_a_bounce_buffer(ipc_pair):
    sender, receiver, _ = ipc_pair
    receiver.post("recv", peer_id="sender", specs=MESSAGE, tag=3)  # plain, unshared buffers
    assert sender.call("send", peer_id="receiver", specs=MESSAGE, tag=3)["bytes"] == helpers.spec_bytes(MESSAGE)
    assert receiver.reply()["match"]


def test_ipc_falls_back_to_host_memory_when_the_receiver_cannot_share(children):
    # The receiver keeps torch's default 'file_descriptor' strategy, whose handles another
    # process cannot open: both ends learn it in the probe and move tensors through host memory.
    sender, receiver = _init(
        children, {"sender": {"same_device": "ipc", "sharing_strategy": "file_system"}, "receiver": {}}
    )
    opened = _connect(sender, receiver)
    assert [o["channel"] for o in opened] == ["host", "host"]
    assert all("file_system" in o["fallback_reason"] for o in opened)
    receiver.post("recv", peer_id="sender", specs=MESSAGE, tag=4)
    assert sender.call("send", peer_id="receiver", specs=MESSAGE, tag=4)["bytes"] == helpers.spec_bytes(MESSAGE)
    assert receiver.reply()["match"]


def test_host_channel_and_default_gloo_between_processes(children):
    sender, receiver, plain = _init(children, {"sender": {"same_device": "host"}, "receiver": {}, "plain": {}})
    assert [o["channel"] for o in _connect(sender, receiver, epoch=0)] == ["host", "host"]
    receiver.post("recv", peer_id="sender", specs=MESSAGE, tag=1)
    sender.call("send", peer_id="receiver", specs=MESSAGE, tag=1)
    assert receiver.reply()["match"]
    # A CPU pair in the default mode is plain gloo; the receiver's own mode does not matter.
    assert [o["channel"] for o in _connect(plain, receiver, epoch=1, sender_id="plain")] == ["gloo", "gloo"]


def test_killed_receiver_fails_an_ipc_send_fast():
    started: list[helpers.PeerProcess] = []  # its own children: one of them is killed
    try:
        _kill_receiver_during_send(_start(started, 2))
    finally:
        for peer in started:
            peer.kill()


def _kill_receiver_during_send(peers: list[helpers.PeerProcess]) -> None:
    shared = {"sharing_strategy": "file_system"}
    sender, receiver = _init(peers, {"sender": {"same_device": "ipc", **shared}, "receiver": shared})
    _connect(sender, receiver)
    # The send waits for the receiver's acknowledgement: a dead receiver fails it at its own
    # timeout (1 s here), never later, whatever the endpoint's default.
    sender.post("send", peer_id="receiver", specs=MESSAGE, tag=2, timeout_s=1.0)
    receiver.kill()  # never posted its receive
    result = sender.reply(timeout_s=PEER_TIMEOUT_S + 10)  # it ends (the reply's wait is a safety net)
    assert result["transfer_error"], result


@pytest.fixture
def file_system_sharing():
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(previous)


def test_ipc_sender_unmaps_buffers_the_receiver_has_freed(file_system_sharing):
    """Each receive buffer is shared once and mapped once; freed ones are released on the next
    frame, so neither side keeps a growing set of mappings (torch would hold the memory)."""
    a = KVTransport("ipc-a", "cpu", timeout_s=PEER_TIMEOUT_S, same_device="ipc")
    b = KVTransport("ipc-b", "cpu", timeout_s=PEER_TIMEOUT_S)
    try:
        opener = threading.Thread(target=a.open_pair, args=("ipc-b", None, "sender", 0))
        opener.start()
        pair_b = b.open_pair("ipc-a", a.address, "receiver", 0)
        opener.join(PEER_TIMEOUT_S)
        pair_a = a.open_pair("ipc-b", None, "sender", 0)  # the open pair, reused
        assert pair_a.channel == pair_b.channel == "ipc"
        kept = torch.zeros(64).share_memory_()  # lives across all transfers, like a KV cache
        for step in range(12):
            fresh = torch.zeros(8).share_memory_()  # a new staging buffer each time
            ops = [b.irecv("ipc-a", [kept[step * 4 : step * 4 + 4]], 1), b.irecv("ipc-a", [fresh], 2)]
            a.send("ipc-b", [torch.full((4,), float(step))], 1)
            a.send("ipc-b", [torch.full((8,), float(-step))], 2)
            for op in ops:
                op.wait(PEER_TIMEOUT_S)
            assert torch.equal(fresh, torch.full((8,), float(-step)))
            del fresh, ops
        assert torch.equal(kept[:48], torch.arange(12.0).repeat_interleave(4))
        importer = pair_a._process_group.importer
        exporter = pair_b._process_group.exporter
        assert importer.num_mapped <= 3 and len(exporter._shares) <= 3
    finally:
        a.close()
        b.close()
