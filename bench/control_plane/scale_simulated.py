"""The control plane at cluster size, on one machine: simulated replicas (engine: simulated,
torch-free, no weights) at several decode-pool sizes, one in-process ingress (Dispatcher +
MembershipFollower + Router) and the controller, all measured in one run.

    python -m splitserve.bench.control_plane.scale_simulated --decode 1,4,16,64 --out bench/results/scale_simulated.json

Each size is measured once per --modes entry on the same cluster, side by side: "poll" (the
ingress polls every replica every poll interval, the controller probes every replica every
probe interval) and "push" (replicas push KV events and load; the controller reads a
load-only push and probes only replicas without a fresh one) -- replica_state.updates.

Per size n (decode replicas; prefill replicas n/4, at least 1) and mode:
- start: seconds until every replica serves;
- idle control plane: this process's CPU share over a quiet window with the ingress polling
  every replica (poll_interval_s) and the controller probing every replica, and again with the
  ingress's poller stopped (so the difference is the ingress's polling); the controller's probe
  round (reconcile_once) wall time; the membership view's size and build time;
- state traffic: polls or pushed frames per second and KV events/s this ingress applies,
  PollReply bytes/s (sampled); push: the ingress's CPU decoding and applying frames;
- load: a closed loop of 4 requests per decode replica over prefix groups (16 shared 256-token
  system prompts + 32 unique tokens each, 16 output tokens): simulated tokens/s (output tokens
  / (wall / speed_factor)), router decision time p50/p99, this process's CPU per token;
- a new decode replica: seconds from add_replicas to routable.
Results in simulated time where they are model time (throughput); control-plane times are wall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import psutil  # noqa: E402
import ray  # noqa: E402

from splitserve.cluster.config import ServeConfig  # noqa: E402
from splitserve.cluster.control.disagg_cluster import DisaggCluster  # noqa: E402
from splitserve.cluster.control.replica_state_feed import ReplicaStateFeed  # noqa: E402
from splitserve.cluster.ingress import request_channel_client  # noqa: E402
from splitserve.cluster.ingress.pushed_state import PushedState  # noqa: E402
from splitserve.cluster.routing.replica_pools import DECODE  # noqa: E402
from splitserve.cluster.routing.router import Router  # noqa: E402
from splitserve.proto.messages.sampling_params import SamplingParams  # noqa: E402

ACTOR_MB = 110  # RSS of one simulated replica here (ray worker + splitserve imports)
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
GROUPS, PREFIX, UNIQUE, PER_REPLICA = 16, 256, 32, 4


class Probe:
    """Bench-only instrumentation: wraps the router's route and the controller's probe round."""

    def __init__(self):
        self.route_s: list[float] = []
        self.probe_s: list[float] = []
        self.polls = 0
        self.events = 0
        self.poll_bytes: list[int] = []
        self.push_s = 0.0  # the ingress's time decoding and applying pushed frames
        original = Router.route
        decode, on_state = request_channel_client.decode_to_ingress, PushedState._on_state

        def timed_decode(body):
            start = time.perf_counter()
            message = decode(body)
            if type(message).__name__ == "ReplicaState":
                self.push_s += time.perf_counter() - start
            return message

        def timed_on_state(pushed, *args):
            start = time.perf_counter()
            try:
                return on_state(pushed, *args)
            finally:
                self.push_s += time.perf_counter() - start

        request_channel_client.decode_to_ingress = timed_decode
        PushedState._on_state = timed_on_state  # type: ignore[method-assign]

        def route(router, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(router, *args, **kwargs)
            finally:
                self.route_s.append(time.perf_counter() - start)

        Router.route = route

    def on_poll(self, pool, replica_id, poll) -> None:
        self.polls += 1
        self.events += len(poll.events)
        if self.polls % 50 == 0:
            self.poll_bytes.append(len(poll.to_bytes()))

    def wrap_controller(self, controller) -> None:
        original = controller.reconcile_once

        async def reconcile_once():
            start = time.perf_counter()
            try:
                return await original()
            finally:
                self.probe_s.append(time.perf_counter() - start)

        controller.reconcile_once = reconcile_once


def config(model: str, num_decode: int, profile: str, speed: float) -> ServeConfig:
    pool = {"num_kv_blocks": 4096, "max_num_seqs": 64, "resources": {"num_cpus": 0}}
    return ServeConfig.model_validate(
        {
            "model": model,
            "engine": "simulated",
            "engine_profile": profile,
            "speed_factor": speed,
            # Chunked prefill at 512 tokens keeps a slowed prefill step (and so a poll that
            # waits for it) within seconds of wall time.
            "prefill": {"replicas": max(1, num_decode // 4), **pool, "max_num_batched_tokens": 512},
            "decode": {"replicas": num_decode, **pool},
            "router": {"policy": "kv", "local_prefill_threshold": 0},
        }
    )


def prompts(rng: random.Random):
    prefixes = [[rng.randrange(10, 1000) for _ in range(PREFIX)] for _ in range(GROUPS)]
    while True:
        yield rng.choice(prefixes) + [rng.randrange(10, 1000) for _ in range(UNIQUE)]


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else 0.0)


async def cpu_share(seconds: float) -> float:
    proc = psutil.Process()
    c0, t0 = proc.cpu_times(), time.monotonic()
    await asyncio.sleep(seconds)
    c1 = proc.cpu_times()
    return (c1.user + c1.system - c0.user - c0.system) / (time.monotonic() - t0)


async def set_mode(cluster: DisaggCluster, mode: str) -> None:
    """Switch this ingress and the controller between polling and pushed state."""
    dispatcher, controller, cfg = cluster.dispatcher, cluster.controller, cluster.cfg
    await dispatcher.stop_following()
    dispatcher.state_updates = mode
    dispatcher.start_following()
    if mode == "poll" and controller.state_feed is not None:
        await controller.state_feed.close()
        controller.state_feed = None
    elif mode == "push" and controller.state_feed is None:
        interval, heartbeat = cfg.controller.probe_interval_s, cfg.replica_state.heartbeat_s
        controller.state_feed = ReplicaStateFeed("controller-bench", interval, heartbeat)


async def measure(
    model: str, n: int, profile: str, speed: float, window_s: float, idle_s: float, warmup_s: float, modes: list[str]
) -> list[dict]:
    probe = Probe()
    cluster = DisaggCluster(config(model, n, profile, speed), model, on_poll=probe.on_poll)
    probe.wrap_controller(cluster.controller)
    rows: list[dict] = []
    start = time.monotonic()
    await cluster.start()
    start_s = time.monotonic() - start
    try:
        for mode in modes:
            await set_mode(cluster, mode)
            out: dict = {"decode": n, "prefill": max(1, n // 4), "mode": mode, "start_s": start_s}
            await measure_mode(cluster, probe, out, n, speed, window_s, idle_s, warmup_s)
            rows.append(out)
        # A new decode replica: from the request to routable (actor start, load, view applied).
        t0 = time.monotonic()
        [replica] = await cluster.add_replicas(DECODE, 1)
        assert replica.replica_id in cluster.router.replica_ids(DECODE)
        for out in rows:
            out["new_replica_routable_s"] = time.monotonic() - t0
    finally:
        await cluster.shutdown()
    return rows


async def measure_mode(
    cluster: DisaggCluster,
    probe: Probe,
    out: dict,
    n: int,
    speed: float,
    window_s: float,
    idle_s: float,
    warmup_s: float,
) -> None:
    await asyncio.sleep(2.0)
    probe.probe_s.clear()
    polls0, push0, t0 = probe.polls, probe.push_s, time.monotonic()
    out["idle_cpu_share"] = await cpu_share(idle_s)
    idle_wall = time.monotonic() - t0
    out["idle_polls_per_s"] = (probe.polls - polls0) / idle_wall
    out["idle_push_cpu_share"] = (probe.push_s - push0) / idle_wall
    out["probe_round_ms_p50"] = pct(probe.probe_s, 50) * 1e3
    out["probe_round_ms_p99"] = pct(probe.probe_s, 99) * 1e3
    await cluster.dispatcher.stop_following()
    out["idle_cpu_share_no_ingress_poll"] = await cpu_share(idle_s)
    cluster.dispatcher.start_following()
    view_start = time.perf_counter()
    for _ in range(20):
        view = cluster.controller.view().to_bytes()
    out["view_build_ms"] = (time.perf_counter() - view_start) / 20 * 1e3
    out["view_bytes"] = len(view)
    await asyncio.sleep(1.0)
    # Load: a closed loop, PER_REPLICA requests in flight per decode replica; tokens are
    # counted as they stream within the window, then every request still running is cancelled.
    gen = prompts(random.Random(n))
    tokens = 0
    counting = False

    async def client():
        nonlocal tokens
        while True:
            async for chunk in cluster.generate(next(gen), PARAMS):
                if counting:
                    tokens += len(chunk.token_ids)

    proc = psutil.Process()
    tasks = [asyncio.create_task(client()) for _ in range(PER_REPLICA * n)]
    await asyncio.sleep(warmup_s)
    counting = True
    c0, t0, polls0, events0, push0 = proc.cpu_times(), time.monotonic(), probe.polls, probe.events, probe.push_s
    bytes0, route0 = len(probe.poll_bytes), len(probe.route_s)
    await asyncio.sleep(window_s)
    counting = False
    wall = time.monotonic() - t0
    c1 = proc.cpu_times()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    cpu = c1.user + c1.system - c0.user - c0.system
    out["tokens"] = tokens
    out["window_wall_s"] = wall
    out["sim_tokens_per_s"] = tokens / (wall / speed)
    out["cpu_share_loaded"] = cpu / wall
    out["cpu_ms_per_token"] = cpu / max(tokens, 1) * 1e3
    out["polls_per_s"] = (probe.polls - polls0) / wall
    out["events_per_s"] = (probe.events - events0) / wall
    out["push_cpu_share_loaded"] = (probe.push_s - push0) / wall
    sampled = probe.poll_bytes[bytes0:] or probe.poll_bytes
    out["poll_bytes_per_s"] = statistics.mean(sampled) * out["polls_per_s"] if sampled else 0.0
    routes = probe.route_s[route0:]
    out["routes"] = len(routes)
    out["route_us_p50"] = pct(routes, 50) * 1e6
    out["route_us_p99"] = pct(routes, 99) * 1e6
    out["resyncs"] = cluster.dispatcher.pushed.num_resyncs
    await asyncio.sleep(1.0)  # the cancelled requests' blocks go back


def frame_cost_us(frames: int = 20000) -> dict:
    """An ingress's CPU per pushed frame, in process (no sockets, no load): decode one
    ReplicaState (a busy replica's: load figures and one KV event of 2 blocks) and apply it
    as PushedState does (events to the index, load to the router). Median of 20 batches."""
    from splitserve.cluster.routing.load import LoadReport
    from splitserve.proto.messages.engine_stats import EngineStats
    from splitserve.proto.messages.kv_events import REMOVED, STORED, KVEvent
    from splitserve.proto.messages.poll_reply import PollReply, TransferTotals
    from splitserve.proto.messages.request_channel import ReplicaState, encode_frame

    router = Router(ServeConfig().router, block_size=16)
    router.add_replica(DECODE, "d", (0, []))
    stats = EngineStats(3000, 4096, 0.27, 48, 3, 900, 0, 123456, 654321, kv_block_bytes=2 << 20)
    bodies = []
    for seq in range(1, frames + 1):
        kind = STORED if seq % 2 else REMOVED  # stored then removed again: the index stays small
        hashes = (seq // 2 * 2 + 1, seq // 2 * 2 + 2)
        reply = PollReply([KVEvent(seq, kind, hashes)], stats, 0, 48, TransferTotals(seq, seq << 20, 0.1))
        bodies.append(encode_frame(ReplicaState(seq, reply))[4:])
    batches = []
    for b in range(20):
        start = time.perf_counter()
        for body in bodies[b * frames // 20 : (b + 1) * frames // 20]:
            frame = request_channel_client.decode_to_ingress(body)
            router.apply_events(DECODE, "d", frame.reply.events)
            router.update_load(DECODE, "d", LoadReport.from_poll(frame.reply))
        batches.append((time.perf_counter() - start) / (frames // 20) * 1e6)
    return {"frame_cost_us": statistics.median(batches), "frame_bytes": len(bodies[-1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (tokenizer + config.json; default: small)")
    parser.add_argument("--decode", default="1,4,16,64", help="decode-pool sizes to run")
    parser.add_argument("--profile", default="llama-8b-h200")
    parser.add_argument("--speed-factor", type=float, default=100.0)
    parser.add_argument("--window-s", type=float, default=15.0, help="measured load window per size")
    parser.add_argument("--idle-s", type=float, default=5.0, help="each idle CPU window")
    parser.add_argument("--warmup-s", type=float, default=8.0, help="load before the window opens")
    parser.add_argument("--modes", default="poll,push", help="replica_state.updates modes, each on the same cluster")
    parser.add_argument("--out", required=True, help="JSON lines, one per size and mode")
    parser.add_argument("--frame-cost", action="store_true", help="only print an ingress's CPU per pushed frame")
    args = parser.parse_args(argv)
    if args.frame_cost:
        print(json.dumps(frame_cost_us()))
        return 0
    from splitserve.cluster.default_model import resolve_model

    model = resolve_model(args.model)
    ray.init(num_cpus=64, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fh:
        for n in [int(x) for x in args.decode.split(",")]:
            need_mb = (n + max(1, n // 4) + 1) * ACTOR_MB
            available = psutil.virtual_memory().available / 2**20
            if need_mb > available * 0.6:
                rows = [{"decode": n, "skipped": f"needs ~{need_mb:.0f} MB, {available:.0f} MB available"}]
            else:
                modes = args.modes.split(",")
                rows = asyncio.run(
                    measure(model, n, args.profile, args.speed_factor, args.window_s, args.idle_s, args.warmup_s, modes)
                )
            for row in rows:
                row.update(profile=args.profile, speed_factor=args.speed_factor)
                print(json.dumps(row), flush=True)
                fh.write(json.dumps(row) + "\n")
            fh.flush()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
