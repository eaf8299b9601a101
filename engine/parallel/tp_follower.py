"""A follower rank's process (ranks 1..N-1 of a tensor-parallel engine): join the group, load
this rank's shard and KV cache, then run each forward and logits command the driver sends.

Between commands it polls for a few milliseconds before it blocks (_POLL_S here; on a CPU group
the step mailbox's counter and the pipe, step_mailbox.py), so the next step's command does not
wait for a sleeping process to wake. On a CPU group the forwards themselves come through that
mailbox in shared memory; every other command, and every command on CUDA, over the pipe.

It exits when the driver says stop, when its pipe closes, when a collective fails or times
out, and -- whatever it is doing -- when the driver process dies: a watchdog thread waits on
the parent's sentinel and ends the process, so no rank outlives its driver.

With a host KV tier (kv_offloading_size) the rank keeps its own KV heads' evicted blocks in
host memory, saving and loading the blocks the driver's scheduler names (tp_host_kv.py).

With an extension (follower_extension.py) the rank also runs it: a forward's work becomes
that forward's per-layer callback, a command goes to it between forwards, and its replies go
back over the same pipe.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from splitserve.engine.config import EngineConfig
from splitserve.engine.host_heap import retain_freed_heap
from splitserve.engine.model.loader import load_model
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.host_kv_cache import HostKVCache, num_host_blocks
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.parallel.follower_extension import FollowerContext, FollowerExtension, FollowerExtensionFactory
from splitserve.engine.parallel.follower_replies import REPLY
from splitserve.engine.parallel.rank_cpus import PinnedThreads, rank_cores
from splitserve.engine.parallel.shard_plan import ShardPlan
from splitserve.engine.parallel.step_broadcast import (
    COMMAND,
    FORWARD,
    HOST_KV,
    LOGITS,
    STOP,
    receive_forward,
    receive_hidden,
)
from splitserve.engine.parallel.step_mailbox import FollowerInbox, MailboxForward
from splitserve.engine.parallel.tp_group import TensorParallelGroup, rank_device

logger = logging.getLogger(__name__)

ALIVE = "alive"  # imports done, about to join the group
READY = "ready"  # shard and KV cache loaded, serving commands
FAILED = "failed"  # (FAILED, one-line reason): the driver raises it
# How long a rank polls its pipe after each command before it blocks on it. A decode step's
# next command follows the last one's logits within a millisecond (0.2-0.8 ms at batches 1-32
# on the bench preset: the driver samples and schedules), and a rank asleep in the pipe's read
# wakes tens to hundreds of microseconds after it is written, which the driver then waits at
# the step's first collective (bench/results/tensor_parallel.md). Polling yields the core to
# anything else runnable on it; an idle engine's ranks block again 5 ms after their last command.
_POLL_S = 5e-3


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(3)  # the driver is gone: nothing here can be finished or handed back

    threading.Thread(target=watch, name="tp-parent-watchdog", daemon=True).start()


def run_follower(
    rank: int,
    size: int,
    host: str,
    port: int,
    config: EngineConfig,
    threads: int,
    conn: Connection,
    extension: FollowerExtensionFactory | None = None,
    own_device: bool = False,
    cores: list[int] | None = None,
) -> None:
    """The spawned process's entry point (multiprocessing spawn: a fresh interpreter), and a
    Ray rank actor's (own_device: its CUDA_VISIBLE_DEVICES holds its own GPU only). cores: the
    driver's, of which this thread pins itself to its rank's block (rank_cpus.py); None: no pin.
    The pin lasts as long as the thread: it is the rank's for the rest of its life."""
    _exit_with_parent()
    retain_freed_heap()  # its forwards allocate as rank 0's do
    if cores:
        PinnedThreads(rank_cores(rank, size, cores)).pin_calling_thread()
    if threads > 0:
        torch.set_num_threads(threads)
    group = None
    try:
        model_config = ModelConfig.from_pretrained(config.model)
        if config.dtype is not None:
            model_config.dtype = config.dtype
        plan = ShardPlan(model_config, size, rank)
        device = rank_device(config.device, rank, size, own_device)
        store = dist.TCPStore(host, port, size, is_master=False, timeout=_timeout(config))
        conn.send((ALIVE, None))
        group = TensorParallelGroup.join(
            plan, device, store, host, config.tensor_parallel_timeout_s, config.tensor_parallel_shm_collectives
        )
        model, _ = load_model(
            config.model, dtype=config.dtype, device=device, quantization=config.quantization, tensor_parallel=group
        )
        kv_cache = KVCache(plan.local_config, config)
        # The host KV tier's slots for this rank's KV heads: as many as the driver's (every
        # rank's blocks are the same size), kv_offloading_size GiB per rank.
        slots = num_host_blocks(kv_cache, config.kv_offloading_size)
        host_kv = HostKVCache(kv_cache, slots) if slots else None
    except Exception as exc:  # the driver reports it as the engine's start-up error
        conn.send((FAILED, f"tensor-parallel rank {rank}: {exc}"))
        return
    conn.send((READY, None))
    ext = None
    try:
        if extension is not None:
            ext = extension(FollowerContext(rank, size, kv_cache, _replier(conn)))
        _serve(model, kv_cache, host_kv, group, conn, ext)
    except Exception as exc:  # a collective failed or timed out: the driver sees its own error
        logger.error("tensor-parallel rank %d stops: %s", rank, exc)
    finally:
        if ext is not None:
            ext.close()
        group.shutdown()


def _replier(conn: Connection):
    lock = threading.Lock()  # the extension replies from its own threads

    def reply(payload) -> None:
        with lock:
            try:
                conn.send((REPLY, payload))
            except (BrokenPipeError, OSError):
                pass  # the driver is gone; this rank stops with it

    return reply


def _serve(
    model,
    kv_cache: KVCache,
    host_kv: HostKVCache | None,
    group: TensorParallelGroup,
    conn: Connection,
    ext: FollowerExtension | None,
):
    hidden_size, dtype = model.config.hidden_size, model.dtype
    # A CPU group's forwards come through shared memory, in order with the pipe's other commands
    # (step_mailbox.py); the driver decides alike (the group's shm is every rank's or none's).
    inbox = FollowerInbox(group.shm, conn) if group.shm is not None else None
    with torch.inference_mode():
        while True:
            try:
                if inbox is not None:
                    header = inbox.next()
                else:
                    _poll_briefly(conn)
                    header = conn.recv()
            except (EOFError, OSError):
                return  # the driver closed its end
            if header[0] == FORWARD:
                if isinstance(header, MailboxForward):  # the batch came with it
                    input_ids, positions, meta = header.input_ids, header.positions, header.meta
                else:
                    input_ids, positions, meta = receive_forward(group, header)
                work = header.rank_work
                on_layer_done = ext.forward_hook(work) if ext is not None and work is not None else None
                hidden = model(input_ids, positions, kv_cache, meta, on_layer_done=on_layer_done)
                rows = header.logits_rows
                if rows is not None:  # the driver's next logits call, without a command of its own
                    if len(rows) < hidden.shape[0]:  # as ModelRunner selects them
                        index = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, device=hidden.device)
                        hidden = hidden.index_select(0, index)
                    model.share_logits(hidden)
            elif header[0] == LOGITS:
                model.share_logits(receive_hidden(group, header, hidden_size, dtype))
            elif header[0] == HOST_KV and host_kv is not None:
                if header.op == "save":
                    host_kv.save(header.device_blocks, header.host_slots)
                else:
                    host_kv.load(header.host_slots, header.device_blocks)
            elif header[0] == COMMAND and ext is not None:
                ext.handle(header.payload)
            elif header[0] == STOP:
                return


def _poll_briefly(conn: Connection) -> None:
    """Return once conn has data or _POLL_S has passed (the caller's recv then blocks)."""
    deadline = time.monotonic() + _POLL_S
    while not conn.poll(0) and time.monotonic() < deadline:
        os.sched_yield()


def _timeout(config: EngineConfig) -> timedelta:
    return timedelta(seconds=config.tensor_parallel_timeout_s)
