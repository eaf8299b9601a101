"""Helpers for tests that drive a DisaggCluster from synchronous pytest code."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import ray
import uvicorn

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.disagg_cluster import DisaggCluster
from splitserve.proto.messages.poll_reply import PollReply


class LoopThread:
    """An asyncio loop in a daemon thread; run(coro) waits for the result with a timeout."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def cluster_config(
    model: str,
    num_prefill: int = 1,
    num_decode: int = 1,
    policy: str = "round-robin",
    lease_s: float = 5.0,
    num_blocks: int = 64,
    **extra,
) -> ServeConfig:
    pool = {"num_kv_blocks": num_blocks, "resources": {"num_cpus": 1}, "torch_threads": 1}
    # As tests/helpers/serve_process.py: a compile worker starts on its module's first
    # constrained request, not with every backend (two idle processes each, most never used).
    extra["grammar"] = {"prestart_workers": False, **extra.get("grammar", {})}
    return ServeConfig.model_validate(
        {
            "model": model,
            "prefill": {"replicas": num_prefill, **pool},
            "decode": {"replicas": num_decode, **pool},
            "router": {"policy": policy, "local_prefill_threshold": 0},
            "kv_transfer_lease_s": lease_s,
            **extra,
        }
    )


def start_cluster(loop: LoopThread, cfg: ServeConfig) -> DisaggCluster:
    cluster = DisaggCluster(cfg, cfg.model, poll_interval_s=0.05)
    loop.run(cluster.start(), timeout=180)
    return cluster


@contextlib.contextmanager
def serving_backend(loop: LoopThread, cfg: ServeConfig, model_dir: str) -> Iterator:
    """A started ServingBackend (frontends' entry point, its controller in-process) on the
    loop, shut down on exit: every pool actor goes with it."""
    from splitserve.cluster.frontend.backend import ServingBackend

    serving = ServingBackend(cfg, model_dir)
    loop.run(serving.start(), timeout=240)
    try:
        yield serving
    finally:
        loop.run(serving.shutdown(), timeout=60)


def pool_states(loop: LoopThread, cluster: DisaggCluster, timeout_s: float | None = 30.0) -> dict[str, PollReply]:
    """Every live replica's PollReply (timeout_s None: no bound of its own, as wait_for_baseline's)."""

    async def collect():
        out = {}
        for pool in (cluster.prefill_pool, cluster.decode_pool):
            for r in pool.live_replicas():
                out[r.replica_id] = PollReply.from_bytes(await r.handle.poll.remote())
        return out

    return loop.run(collect(), timeout=timeout_s)


def wait_for_baseline(loop: LoopThread, cluster: DisaggCluster, timeout_s: float | None = None) -> dict[str, PollReply]:
    """Poll until every live replica holds no blocks, pins nothing and runs nothing. timeout_s
    None (the default): no bound of its own -- freeing can lag far behind on a busy machine --,
    the test's timeout ends it (wait_until notes the replicas still busy); a number: a bound
    the test means (freed within a lease, say)."""
    busy: dict[str, PollReply] = {}

    def settled() -> dict[str, PollReply] | None:
        states = pool_states(loop, cluster, timeout_s)
        busy.clear()
        busy.update(
            (rid, s)
            for rid, s in states.items()
            if s.engine.num_free_blocks != s.engine.num_blocks
            or s.num_pinned
            or s.engine.num_running
            or s.engine.num_waiting
        )
        return None if busy else states

    return wait_until(settled, timeout_s, lambda: f"block pools not back to baseline: {busy}", interval_s=0.1)


def wait_until(predicate, timeout_s: float | None, message, interval_s: float = 0.05):
    """Poll predicate() until it returns something truthy (returned); AssertionError at the
    timeout, saying message (a str, or a callable that describes the state then).

    timeout_s None: no deadline of its own, for waits whose length no wall-clock bound can
    know on a busy machine; the test's own timeout cancels it, and the failure then carries
    message as a note."""
    if timeout_s is None and threading.current_thread() is not threading.main_thread():
        # pytest-timeout interrupts the main thread only: this wait would outlive the test.
        raise ValueError("wait_until without a deadline runs only on the test's main thread")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            value = predicate()
            if value:
                return value
            if deadline is not None and time.monotonic() > deadline:
                raise AssertionError(f"{message() if callable(message) else message} (after {timeout_s:.1f} s)")
            time.sleep(interval_s)
    except BaseException as cancelled:
        if deadline is None:
            try:
                cancelled.add_note(f"while waiting: {message() if callable(message) else message}")
            except Exception as describing:  # the state could not be described: say why, keep the cause
                cancelled.add_note(f"while waiting (state not described: {describing!r})")
        raise


def pool_diagnostics(cluster: DisaggCluster, pool: str) -> str:
    """What a failed wait on a pool reports: its last lifecycle events, its routed replicas and
    Ray's free CPUs (a replica Ray cannot place waits out its start timeout)."""
    events = [(e.what, e.replica_id, e.detail) for e in getattr(cluster.controller, "events", ()) if e.pool == pool]
    return (
        f"{pool} events {events[-8:]}; routed {sorted(cluster.router.replica_ids(pool))}; "
        f"Ray CPUs free {ray.available_resources().get('CPU', 0.0)} of {ray.cluster_resources().get('CPU', 0.0)}"
    )


def wait_for_refill(cluster: DisaggCluster, pool: str, num_replicas: int) -> None:
    """Until the pool routes num_replicas again after a loss: a restart backoff, then a start the
    pool's own start timeout bounds (the safety net waits past it, not for a guess at how long a
    start takes on this machine)."""
    timeout_s = cluster.pools[pool].start_timeout_s + 60
    wait_until(
        lambda: cluster.live_replicas(pool) == num_replicas,
        timeout_s,
        lambda: f"the {pool} pool was not refilled to {num_replicas}: {pool_diagnostics(cluster, pool)}",
        0.2,
    )


class LoopHttpServer:
    """uvicorn serving `app` on 127.0.0.1 (OS-chosen port) inside a LoopThread's event loop,
    the loop that owns the cluster's dispatcher, so frontend and cluster share one loop."""

    def __init__(self, loop: LoopThread, app):
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.loop = loop
        self._done = None

    def __enter__(self) -> LoopHttpServer:
        self._done = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop.loop)
        wait_until(lambda: self.server.started or self._done.done(), None, "uvicorn did not start")
        if self._done.done():
            self._done.result()  # raises what stopped it
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._done.result(15)

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def grpc_frontend_port(loop: LoopThread, backend) -> Iterator[int]:
    """The port of a GrpcFrontend serving `backend` on 127.0.0.1 (OS-chosen port) inside the
    loop that owns the cluster, stopped on exit."""
    from splitserve.cluster.frontend.grpc.server import GrpcFrontend

    frontend = GrpcFrontend(backend)
    port = loop.run(frontend.start("127.0.0.1", 0))
    try:
        yield port
    finally:
        loop.run(frontend.stop(1.0))


@contextlib.contextmanager
def grpc_stub(loop: LoopThread, backend) -> Iterator:
    """A SplitServeStub on a channel to a grpc_frontend_port of `backend`."""
    import grpc

    from splitserve.proto import load_stubs

    _, pb2_grpc = load_stubs()
    with grpc_frontend_port(loop, backend) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb2_grpc.SplitServeStub(channel)


HELD_S = 3600.0  # a chaos fault (hang, stall, delay) that holds a request until the test switches it off
FAIL_FAST_S = 1.0  # what docs/RELIABILITY.md quotes, on this box when it is not overloaded
RTTS_PER_FAILURE = 20  # a failure reaches its client in a few actor round trips and one step


def fail_fast_bound_s(handle) -> float:
    """How soon a failure must reach its client: FAIL_FAST_S, or more when the machine is so
    busy that RTTS_PER_FAILURE round trips to the replica (measured now) take longer. A bound
    relative to the machine's speed at the moment, not a fixed wall-clock one."""
    rtts = []
    for _ in range(3):
        start = time.monotonic()
        ray.get(handle.poll.remote(), timeout=10)
        rtts.append(time.monotonic() - start)
    return max(FAIL_FAST_S, RTTS_PER_FAILURE * sorted(rtts)[1])  # the median of three


def slow_decode(loop, backend, hang_s: float) -> None:
    """Every decode step hangs hang_s (0: none): a floor under a stream's duration (never a
    ceiling), so a state in the middle of some work lasts long enough to be seen."""
    (replica,) = backend.cluster.decode_pool.live_replicas()
    hang_steps = 10**6 if hang_s else 0
    ray.get(replica.handle.inject_fault.remote(hang_s=hang_s, hang_steps=hang_steps), timeout=30)
