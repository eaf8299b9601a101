"""One controller probe of one replica: its load and health (PollReply without KV events),
or why it is gone -- its actor died, or its engine loop stopped for good (then the actor
still runs and must be killed)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray

from splitserve.cluster.control.worker_pool import Replica
from splitserve.engine.engine_errors import EngineLoopStopped
from splitserve.proto.messages.poll_reply import PollReply

PROBE_TIMEOUT_S = 10.0  # a busy step may hold the probe a while; a hung replica is not dead


@dataclass(frozen=True)
class ProbeResult:
    reply: PollReply | None = None  # None: gone, or no answer in time
    dead: bool = False
    kill: bool = False  # dead but its actor still runs (its engine loop stopped)
    reason: str = ""

    @property
    def idle(self) -> bool:
        """Nothing left to wait for: it runs, queues, streams and pins nothing (or is dead)."""
        return self.dead or (self.reply is not None and self.reply.is_idle)


async def probe(replica: Replica, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeResult:
    try:
        reply = PollReply.from_bytes(await asyncio.wait_for(replica.handle.probe.remote(), timeout_s))
    except ray.exceptions.RayActorError as exc:
        return ProbeResult(dead=True, reason=f"actor died: {_short(exc)}")
    except EngineLoopStopped as exc:  # raised inside the replica, re-raised here by Ray
        return ProbeResult(dead=True, kill=True, reason=f"engine loop stopped: {_short(exc)}")
    except (TimeoutError, ray.exceptions.RayError) as exc:
        return ProbeResult(reason=f"no answer: {_short(exc)}")
    if not reply.is_serving:  # the replica reports its engine loop stopped for good
        return ProbeResult(reply, dead=True, kill=True, reason=f"engine loop stopped: {reply.error}")
    return ProbeResult(reply)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__
