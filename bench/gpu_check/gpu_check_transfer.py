"""gpu_check check 5: KV transfer between a prefill and a decode process on one device.

NCCL refuses two ranks on one GPU, so such a pair runs on the transport's same-device channel:
`ipc` (the sender copies into the receiver's cache through CUDA IPC), which `auto` must pick, and
`host` (staged through host memory over gloo), its fallback. Each channel carries the real
KVSender -> PostedReceive path, layer by layer: an in-place transfer (ascending block runs, sent
from and received into the caches directly) and a packed one (scattered blocks: the gather and
scatter kernels). Every transfer is checked bit for bit, and every other block must stay zero.
On CPU, `auto` is gloo and `ipc` runs the same protocol over shared memory.
"""

from __future__ import annotations

import queue
import statistics
import time
import traceback

import torch

from splitserve.bench.gpu_check.gpu_check_ops import item

REPEATS = 5  # the first of each case opens mappings and warms up; the rest are timed
_TIMEOUT_S = 60.0
_SHAPE = {"layers": 16, "kv_heads": 8, "head_dim": 128, "blocks": 2048, "moved": 512}  # 1 MiB per block
_TINY_SHAPE = {"layers": 2, "kv_heads": 2, "head_dim": 16, "blocks": 32, "moved": 8}


def _cases(device: torch.device) -> dict[str, tuple[str, str, str]]:
    """name -> (the sender's same_device mode, the receiver's device, the channel it must get).
    The sender is on cuda:0 (or cpu); a second GPU, when there is one, adds the NCCL pair."""
    if device.type == "cpu":
        return {"auto": ("auto", "cpu", "gloo"), "ipc": ("ipc", "cpu", "ipc"), "host": ("host", "cpu", "host")}
    cases = {"auto": ("auto", "cuda:0", "ipc"), "host": ("host", "cuda:0", "host")}
    if torch.cuda.device_count() >= 2:
        cases["nccl"] = ("auto", "cuda:1", "nccl")
    return cases


def _layouts(shape: dict) -> dict[str, tuple[list[int], list[int]]]:
    n, total = shape["moved"], shape["blocks"]
    gen = torch.Generator().manual_seed(5)
    src, dst = torch.randperm(total, generator=gen)[:n].tolist(), torch.randperm(total, generator=gen)[:n].tolist()
    return {"in-place": (list(range(1, 1 + n)), list(range(total - n, total))), "packed": (src, dst)}


def _kv_cache(shape: dict, device: torch.device, seed: int | None):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.model_config import ModelConfig
    from splitserve.engine.ops.kv_cache import KVCache

    heads = shape["kv_heads"] * 4
    model = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=512,
        hidden_size=heads * shape["head_dim"],
        intermediate_size=256,
        num_hidden_layers=shape["layers"],
        num_attention_heads=heads,
        num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"],
        max_position_embeddings=4096,
    )
    cache = KVCache(model, EngineConfig(model="-", num_kv_blocks=shape["blocks"], dtype="bfloat16", device=str(device)))
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen, device=device))
    return cache


def _sender(device, shape, cases, inbox, outbox) -> dict:
    from splitserve.kvtransfer import KVTransport
    from splitserve.kvtransfer.kv_sender import KVSender, SendJob

    cache, report = _kv_cache(shape, device, seed=1), {}
    for case, (mode, _, _) in cases.items():
        with KVTransport(f"prefill-{mode}", device, timeout_s=_TIMEOUT_S, same_device=mode) as transport:
            outbox.put(transport.address)
            pair = transport.open_pair(f"decode-{case}", None, "sender", 0)
            report[case] = {"channel": pair.channel, "fallback_reason": pair.fallback_reason}
            sender = KVSender(transport, cache)
            for index, (src, _) in enumerate([v for v in _layouts(shape).values() for _ in range(REPEATS)]):
                inbox.get(timeout=_TIMEOUT_S)  # the receiver has posted
                started = time.time()
                job = SendJob(f"req-{index}", f"decode-{case}", index + 1, src, layerwise=True)
                sender.send_all(job)
                job.done.result(_TIMEOUT_S)
                outbox.put(started)
            sender.close()
    return report


def _receiver(device, shape, cases, inbox, outbox) -> dict:
    from splitserve.kvtransfer import KVTransport
    from splitserve.kvtransfer.kv_receiver import PostedReceive

    report, caches = {}, {}
    for case, (mode, device_name, _) in cases.items():
        device = torch.device(device_name)
        if device not in caches:  # the receiving cache, and what the sender's holds
            caches[device] = (_kv_cache(shape, device, seed=None), _kv_cache(shape, device, seed=1).kv)
        cache, expected = caches[device]
        with KVTransport(f"decode-{case}", device, timeout_s=_TIMEOUT_S) as transport:
            transport.open_pair(f"prefill-{mode}", inbox.get(timeout=_TIMEOUT_S), "receiver", 0)
            for index, (layout, (src, dst)) in enumerate(
                [kv for kv in _layouts(shape).items() for _ in range(REPEATS)]
            ):
                posted = PostedReceive(transport, cache, f"prefill-{mode}", index + 1, dst, layerwise=True)
                outbox.put(index)
                num_bytes, _ = posted.complete(_TIMEOUT_S)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                finished = time.time()
                seconds = finished - inbox.get(timeout=_TIMEOUT_S)
                exact = torch.equal(cache.kv[:, :, dst], expected[:, :, src])
                cache.kv[:, :, dst] = 0
                untouched = not cache.kv.any().item()  # nothing outside the blocks was written
                record = report.setdefault(f"{case}/{layout}", {"seconds": [], "exact": True, "bytes": num_bytes})
                record["seconds"].append(seconds)
                record["exact"] &= exact and untouched
    return report


def _endpoint(role: str, device_name: str, cases: dict, tiny: bool, inbox, outbox, results) -> None:
    """A child process: one end of every pair (spawned, so CUDA starts fresh in it)."""
    try:
        device = torch.device(device_name)
        if device.type == "cpu":  # the ipc channel shares CPU tensors by file name
            torch.multiprocessing.set_sharing_strategy("file_system")
        shape = _TINY_SHAPE if tiny else _SHAPE
        run = _sender if role == "sender" else _receiver
        results.put((role, run(device, shape, cases, inbox, outbox)))
    except BaseException:
        results.put((role, {"error": traceback.format_exc()}))


def check_transfer(device: torch.device, tiny: bool) -> dict:
    context = torch.multiprocessing.get_context("spawn")
    to_sender, to_receiver, results = context.Queue(), context.Queue(), context.Queue()
    device_name = "cuda:0" if device.type == "cuda" else "cpu"
    cases = _cases(device)
    processes = [
        context.Process(target=_endpoint, args=("sender", device_name, cases, tiny, to_sender, to_receiver, results)),
        context.Process(target=_endpoint, args=("receiver", device_name, cases, tiny, to_receiver, to_sender, results)),
    ]
    for process in processes:
        process.start()
    reports = {}
    try:
        for _ in processes:
            role, report = results.get(timeout=_TIMEOUT_S * 3)
            reports[role] = report
    except queue.Empty:
        reports.setdefault("error", "an endpoint gave no result in time")
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    errors = [r["error"] for r in reports.values() if isinstance(r, dict) and "error" in r]
    if errors or "error" in reports or len(reports) < 2:
        return {"items": [item("two-process transfer", "fail", "\n".join(map(str, errors)) or str(reports))]}
    return {"items": _items(reports, cases, device)}


def _items(reports: dict, cases: dict, device: torch.device) -> list[dict]:
    items = []
    if device.type == "cuda" and "nccl" not in cases:
        items.append(item("NCCL path", "info", "not run: one GPU cannot host a 2-rank NCCL group; see docs/GPU.md"))
    for case, (mode, receiver_device, channel) in cases.items():
        got = reports["sender"][case]
        note = f"same_device={mode!r}, receiver on {receiver_device}: chose {got['channel']!r}, expected {channel!r}"
        if got["fallback_reason"]:
            note += f"; fell back: {got['fallback_reason']}"
        items.append(item(f"{case} channel", "pass" if got["channel"] == channel else "fail", note))
        for layout in ("in-place", "packed"):
            record = reports["receiver"][f"{case}/{layout}"]
            timed = record["seconds"][1:]
            median = statistics.median(timed)
            items.append(
                item(
                    f"{got['channel']} {layout}",
                    "pass" if record["exact"] else "fail",
                    "bit-exact, nothing else written" if record["exact"] else "data differs or stray writes",
                    mib=record["bytes"] / 2**20,
                    first_ms=record["seconds"][0] * 1e3,
                    median_ms=median * 1e3,
                    gb_per_s=record["bytes"] / median / 1e9,
                )
            )
    return items
