"""ChannelStream: one request sent straight to a decode replica over its request channel, as an
ingress sends it, consumed on a test's cluster loop (tests/workers/test_loop_failures.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import ray

from splitserve.cluster.ingress.request_channel_client import RequestChannelClient
from splitserve.decode.decode_worker import PrefillFailedError
from splitserve.engine.engine_errors import EngineLoopStopped, EngineStepError
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.request_channel import Failed, FailureKind, Submit
from splitserve.proto.messages.sampling_params import SamplingParams


class ChannelStream:
    """One request sent straight to a decode replica over its request channel (as an ingress
    does), consumed on the cluster's loop: its chunks, when it ended, and how (a Failed frame
    becomes the error the replica reported)."""

    def __init__(self, loop, handle, request_id: str, ids: list[int], params: SamplingParams, prefill=None):
        self.chunks: list[StreamChunk] = []
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.done = threading.Event()
        replica_id = ray.get(handle.ready.remote(), timeout=30)
        address = ray.get(handle.channel_address.remote(), timeout=30)
        submit = Submit(request_id, ids, params, None if prefill is None else prefill.replica_id)

        # Held here: a channel's reader and the tasks waiting on it only reference each other.
        self.channel = channel = RequestChannelClient(replica_id, address, f"test-{request_id}")

        async def consume() -> None:
            try:
                queue = await channel.submit(submit)
                while True:
                    item = await queue.get()
                    if not isinstance(item, StreamChunk):
                        raise _as_error(item)
                    self.chunks.append(item)
                    if item.finished:
                        break
            except BaseException as exc:
                self.error = exc
            finally:
                self.ended_at = time.monotonic()
                self.done.set()
                await channel.close()

        asyncio.run_coroutine_threadsafe(consume(), loop.loop)

    def wait(self, timeout_s: float = 60.0) -> ChannelStream:
        assert self.done.wait(timeout_s), "the stream never ended"
        return self

    @property
    def token_ids(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]


def _as_error(item) -> BaseException:
    if not isinstance(item, Failed):
        return item  # ChannelClosed
    if item.kind is FailureKind.STEP_FAILED:
        return EngineStepError(item.message)
    if item.kind is FailureKind.REPLICA_DEAD:
        return EngineLoopStopped(item.message)
    if item.kind.value.startswith("prefill"):
        return PrefillFailedError(item.message, item.kind)
    return RuntimeError(f"{item.kind}: {item.message}")
