"""TensorParallelRanks: the driver's side of a tensor-parallel engine's ranks -- spawn the
follower processes, form the group with them, send them each step, and stop them.

Rank 0 is the engine's own process (the driver); ranks 1..N-1 are processes forked from
multiprocessing's fork server (follower_context: no forked threads or device state of the
driver's) running engine/parallel/tp_follower.py.
Every wait is bounded: a rank that does not start, join or load within
tensor_parallel_timeout_s, or dies on the way, is a start-up error naming it. close() stops
them (a stop command, then terminate, then kill), and it runs by itself when the engine is
collected or the interpreter exits; a driver killed outright takes its ranks with it (their
watchdog, tp_follower.py).

A served replica's followers are not its children but rank actors of its gang, started by
whoever holds them (a FollowerLauncher, runtime/tp_rank_actor.py): each dials the driver's
listener (FollowerStart.address) and that connection is its pipe. Their lifetime is the gang's
owner's: close() sends them stop and closes the connections, and they kill nothing.

Each follower may also run an extension beside its forward (follower_extension.py, the KV data
plane's rank side): command() hands it a payload, a forward's per-layer callback may carry it
work for that forward, and listen() reads its replies.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from splitserve.engine.config import EngineConfig
from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.parallel.follower_connections import accept_followers
from splitserve.engine.parallel.follower_extension import FollowerExtensionFactory
from splitserve.engine.parallel.follower_replies import ReplyListener
from splitserve.engine.parallel.rank_cpus import PinnedThreads, node_cores, rank_cores, threads_per_rank
from splitserve.engine.parallel.shard_plan import ShardPlan
from splitserve.engine.parallel.step_broadcast import (
    COMMAND,
    HOST_KV,
    LOGITS,
    STOP,
    CommandHeader,
    HostCopyHeader,
    LogitsHeader,
    broadcast_forward,
    forward_header,
)
from splitserve.engine.parallel.step_mailbox import WAKE, StepMailbox
from splitserve.engine.parallel.tp_follower import ALIVE, FAILED, READY, run_follower
from splitserve.engine.parallel.tp_group import TensorParallelError, TensorParallelGroup, rank_device

_HOST = "127.0.0.1"  # one node: the ranks of a colocated engine share its host
_STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class FollowerStart:
    """What a follower rank started elsewhere needs: the group's rendezvous (host, store_port)
    and the driver's listener to dial (address, authkey); it first sends its rank there."""

    size: int
    host: str
    store_port: int
    config: EngineConfig
    threads: int
    address: tuple[str, int]
    authkey: bytes
    extension: FollowerExtensionFactory | None = None  # what each rank runs beside its forward
    cores: list[int] | None = None  # the driver's cores, each rank pins to its block (rank_cpus.py)


# Starts ranks 1..size-1 somewhere on the driver's node without waiting for them. Launched
# ranks, and the driver beside them, are processes with a device each (Ray rank actors: Ray
# sets each one's CUDA_VISIBLE_DEVICES to its own GPU), unlike spawned ranks, which share the
# driver's view of every GPU of the node (tp_group.rank_device).
FollowerLauncher = Callable[[FollowerStart], None]


class TensorParallelRanks:
    def __init__(
        self,
        config: EngineConfig,
        plan: ShardPlan,
        launch: FollowerLauncher | None = None,
        extension: FollowerExtensionFactory | None = None,
    ):
        """Spawn ranks 1..N-1 (or have launch start them) and form the group (as rank 0) with
        them; their shards load meanwhile: wait_ready() waits for that. config: the engine's,
        its KV block count resolved (every rank allocates the same blocks). extension: what
        each follower runs beside its forward (follower_extension.py)."""
        self.config = config
        self.size = plan.size
        self.timeout_s = config.tensor_parallel_timeout_s
        self.extension = extension
        self._lock = threading.Lock()  # a command and its collectives go out as one
        self._pipe_lock = threading.Lock()  # one header at a time on the pipes, from any thread
        self._listener: ReplyListener | None = None
        self._failure: str | None = None  # the first failed command's error (stop_on_failure)
        self._mailbox: StepMailbox | None = None
        device = rank_device(config.device, 0, plan.size, own_device=launch is not None)
        timeout = timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(_HOST, 0, plan.size, is_master=True, timeout=timeout, wait_for_workers=False)
        threads = threads_per_rank(plan.size) if device.type == "cpu" else 0
        cores = node_cores() if device.type == "cpu" and config.tensor_parallel_pin_cpus else None
        # The thread that runs rank 0's forward pins itself at its first call (tp_model.py).
        self.pinned = PinnedThreads(rank_cores(0, plan.size, cores) if cores else None)
        self._processes: list = []
        self._conns: list[Connection] = []
        deadline = time.monotonic() + self.timeout_s
        if launch is None:
            self._spawn(plan.size, store.port, threads, cores)
        else:
            start = FollowerStart(plan.size, _HOST, store.port, config, threads, ("", 0), b"", extension, cores)
            self._conns = accept_followers(launch, start, deadline, self.timeout_s)
        self._finalizer = weakref.finalize(self, _stop, self._processes, self._conns, self.pinned)
        try:
            self._expect(ALIVE, "start", deadline)
            self.group = TensorParallelGroup.join(
                plan, device, store, _HOST, self.timeout_s, config.tensor_parallel_shm_collectives
            )
        except BaseException:
            self.close()
            raise
        self._store = store  # the followers' rendezvous: kept while they may still read it
        # A CPU group's forwards go through shared memory (step_mailbox.py); else the pipe.
        self._mailbox = StepMailbox(self.group.shm) if self.group.shm is not None else None
        if threads:
            torch.set_num_threads(threads)

    def _spawn(self, size: int, store_port: int, threads: int, cores: list[int] | None) -> None:
        context = follower_context()
        for rank in range(1, size):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=run_follower,
                args=(rank, size, _HOST, store_port, self.config, threads, child_end, self.extension, False, cores),
                name=f"splitserve-tp-rank-{rank}",
                daemon=True,
            )
            process.start()
            child_end.close()
            self._processes.append(process)
            self._conns.append(parent_end)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def wait_ready(self) -> None:
        """Return once every follower has loaded its shard; raise (and stop them) otherwise."""
        try:
            self._expect(READY, "load its shard", time.monotonic() + self.timeout_s)
        except BaseException:
            self.close()
            raise

    def _expect(self, expected: str, what: str, deadline: float) -> None:
        for rank, conn in enumerate(self._conns, start=1):
            # A spawned rank's exit shows on its sentinel; a launched one's as its connection's end.
            sentinel = [self._processes[rank - 1].sentinel] if self._processes else []
            ready = wait([conn, *sentinel], timeout=max(deadline - time.monotonic(), 0.0))
            if conn in ready:
                try:
                    kind, reason = conn.recv()
                except (EOFError, OSError):
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited before it could {what}") from None
                if kind == FAILED:
                    raise TensorParallelError(reason)
                if kind == expected:
                    continue
            elif ready:
                code = self._processes[rank - 1].exitcode
                raise TensorParallelError(f"tensor-parallel rank {rank} exited (code {code}) before it could {what}")
            raise TensorParallelError(f"tensor-parallel rank {rank} did not {what} within {self.timeout_s:.0f}s")

    def send_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        rank_work=None,
        logits_rows: list[int] | None = None,
    ) -> None:
        """Hand the step to every follower (with the extension's work for it, and the rows whose
        logits each then computes); the caller then runs its own forward (the group's
        collectives pair them up)."""
        if self._mailbox is not None and rank_work is None and self._post(input_ids, positions, meta, logits_rows):
            return
        header = forward_header(input_ids, meta, rank_work, logits_rows)
        self._send(header)
        broadcast_forward(self.group, input_ids, positions, meta)

    def _post(self, input_ids, positions, meta: AttentionMetadata, logits_rows: list[int] | None) -> bool:
        """The forward through the step mailbox (step_mailbox.py), in order with the pipe's
        messages; False when it does not fit there."""
        self.check_running()
        with self._pipe_lock:
            if self._mailbox is None or not self._mailbox.post_forward(input_ids, positions, meta, logits_rows):
                return False
            for rank in self._mailbox.parked():
                self._write(rank, self._conns[rank - 1], WAKE)
        return True

    def send_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hand the hidden rows whose logits the driver computes next; returns them contiguous."""
        hidden = hidden.contiguous()
        self._send(LogitsHeader(LOGITS, int(hidden.shape[0])))
        return self.group.broadcast(hidden)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @contextlib.contextmanager
    def stop_on_failure(self):
        """A command that failed part-way leaves the ranks at different points of their
        collectives: no later step could pair them up again, so they are stopped and every
        later command fails at once, naming the first failure."""
        try:
            yield
        except BaseException as exc:
            if self._failure is None:
                self._failure = f"{type(exc).__name__}: {exc}"
                self.close()
            raise

    def send_host_copy(self, op: str, host_slots: list[int], device_blocks: list[int]) -> None:
        """Have every follower make the host KV tier's copy on its own KV heads, after the
        forwards sent before and before those sent after (tp_host_kv.py)."""
        self._send(HostCopyHeader(HOST_KV, op, list(host_slots), list(device_blocks)))

    def command(self, payload) -> None:
        """Hand payload to every follower's extension, after what was sent before (any thread;
        it does not wait for a step in flight: the follower takes it after that forward)."""
        self._send(CommandHeader(COMMAND, payload))

    def listen(self, handler) -> None:
        """From now on, handler(rank, reply) for each reply of a follower's extension, on one
        thread; handler(rank, None) once when a rank's connection ends. Once per engine."""
        if self._listener is not None:
            raise TensorParallelError("the tensor-parallel ranks' replies already have a listener")
        self._listener = ReplyListener(self._conns, handler)

    def _send(self, header) -> None:
        self.check_running()
        with self._pipe_lock:
            # With a mailbox, tagged with the forwards posted before it: the follower's order.
            message = header if self._mailbox is None else (self._mailbox.posted, header)
            for rank, conn in enumerate(self._conns, start=1):
                self._write(rank, conn, message)
            if self._mailbox is not None:
                self._mailbox.message_sent()

    def check_running(self) -> None:
        """Raise, naming the first failure, once a failed command stopped the ranks."""
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel ranks were stopped after a failed step ({self._failure})")

    @staticmethod
    def _write(rank: int, conn: Connection, message) -> None:
        try:
            conn.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise TensorParallelError(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def close(self) -> None:
        """Stop the followers (idempotent)."""
        if self._listener is not None:
            self._listener.stop()
        self._finalizer()
        group = getattr(self, "group", None)
        if group is not None:
            group.shutdown()


def follower_context():
    """Where followers start: forked from multiprocessing's fork server, a fresh interpreter
    that imported torch and the follower once (no threads, no device context of the driver's
    to inherit, as with spawn), rather than a fresh interpreter importing them for each rank:
    ~1.5 CPU-s a rank on this project's CPUs, paid again at every engine start. The server
    lives as long as this process; every start after the first reuses it."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([run_follower.__module__])
    return context


def _stop(processes: list, conns: list[Connection], pinned: PinnedThreads) -> None:
    pinned.release()
    for conn in conns:
        try:
            conn.send((STOP,))
        except (BrokenPipeError, OSError):
            pass
    deadline = time.monotonic() + _STOP_GRACE_S
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.1))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)
    for conn in conns:
        conn.close()
