"""A KVTransport endpoint in a child process, driven by JSON lines over its stdin/stdout.

Tests run one endpoint in the pytest process and the peer here, so pairs really span two
processes (and the peer can be killed). Tensors are rebuilt on both sides from
(shape, dtype, seed) specs, so only small JSON crosses the pipe.

    python tests/helpers/transport.py    # one JSON command per line in, one reply per line out;
                                          # it exits at end of input
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REPLY_TIMEOUT_S = 30.0


def make_tensor(shape, dtype_name: str, seed: int):
    import torch

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=generator).to(dtype)
    return torch.randint(-1000, 1000, tuple(shape), generator=generator, dtype=dtype)


def spec_bytes(specs) -> int:
    return sum(make_tensor(*spec).nbytes for spec in specs)


class PeerProcess:
    """The parent's handle on a child endpoint: post commands, collect replies with timeouts."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read_replies, daemon=True).start()

    def _read_replies(self) -> None:
        for line in self.process.stdout:
            self._replies.put(json.loads(line))
        self._replies.put({"error": "peer process exited"})

    def post(self, op: str, **args) -> None:
        """Send a command without waiting (the peer may block in it, e.g. in open_pair)."""
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def reply(self, timeout_s: float = REPLY_TIMEOUT_S) -> dict:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"peer gave no reply within {timeout_s}s") from None

    def call(self, op: str, **args) -> dict:
        self.post(op, **args)
        result = self.reply()
        if "error" in result:
            raise AssertionError(f"peer {op} failed: {result['error']}")
        return result

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def _serve() -> None:
    import torch

    from splitserve.kvtransfer import KVTransport, TransferError

    transport: KVTransport | None = None
    posted: dict[str, tuple] = {}

    def _recv_buffers(command: dict) -> tuple[list, list]:
        """The tensors the peer sends (rebuilt from specs) and empty buffers to receive them;
        in shared memory when asked (the ipc channel receives CPU tensors there)."""
        expected = [make_tensor(*spec) for spec in command["specs"]]
        buffers = [torch.zeros_like(t) for t in expected]
        if command.get("shared"):
            buffers = [b.share_memory_() for b in buffers]
        return expected, buffers

    def handle(command: dict) -> dict:
        nonlocal transport
        op = command["op"]
        if op == "ping":  # answered once the child has imported torch and the transport
            return {}
        if op == "init":  # again: the previous transport closes, a new one takes its place
            if transport is not None:
                transport.close()
            if command.get("sharing_strategy"):
                torch.multiprocessing.set_sharing_strategy(command["sharing_strategy"])
            transport = KVTransport(
                command["endpoint_id"],
                "cpu",
                timeout_s=command["timeout_s"],
                same_device=command.get("same_device", "auto"),
            )
            return {}
        if op == "address":
            return {"address": list(transport.address)}
        if op == "open":
            address = tuple(command["address"]) if command.get("address") else None
            pair = transport.open_pair(command["peer_id"], address, command["role"], command["epoch"])
            return {"channel": pair.channel, "fallback_reason": pair.fallback_reason}
        if op == "send":
            tensors = [make_tensor(*spec) for spec in command["specs"]]
            return {"bytes": transport.send(command["peer_id"], tensors, command["tag"], command.get("timeout_s"))}
        if op == "recv":
            expected, buffers = _recv_buffers(command)
            num_bytes = transport.recv(command["peer_id"], buffers, command["tag"], command.get("timeout_s"))
            return {"bytes": num_bytes, "match": all(torch.equal(a, b) for a, b in zip(buffers, expected))}
        if op in ("isend", "irecv"):  # post now, wait later with "wait" and the same name
            if op == "isend":
                expected, buffers = None, [make_tensor(*spec) for spec in command["specs"]]
                posted[command["name"]] = (transport.isend(command["peer_id"], buffers, command["tag"]), None, None)
            else:
                expected, buffers = _recv_buffers(command)
                posted[command["name"]] = (
                    transport.irecv(command["peer_id"], buffers, command["tag"]),
                    expected,
                    buffers,
                )
            return {}
        if op == "wait":
            transfer, expected, buffers = posted.pop(command["name"])
            num_bytes = transfer.wait(command.get("timeout_s"))
            match = expected is None or all(torch.equal(a, b) for a, b in zip(buffers, expected))
            return {"bytes": num_bytes, "match": match}
        if op == "stats":
            stats = transport.stats()
            return {
                "bytes_sent": stats.bytes_sent,
                "bytes_received": stats.bytes_received,
                "num_sends": stats.num_sends,
                "num_recvs": stats.num_recvs,
            }
        if op == "peers":
            return {"peers": transport.peers()}
        raise ValueError(f"unknown op {op!r}")

    for line in sys.stdin:
        command = json.loads(line)
        started = time.monotonic()
        try:
            result = handle(command)
        except Exception as exc:  # report it to the test instead of dying mid-protocol
            result = {"error": f"{type(exc).__name__}: {exc}", "transfer_error": isinstance(exc, TransferError)}
        result["seconds"] = time.monotonic() - started
        print(json.dumps(result), flush=True)
    if transport is not None:
        transport.close()


if __name__ == "__main__":
    _serve()
