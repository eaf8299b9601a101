"""KV transfer between prefill and decode tensor-parallel sizes: bytes and time per request
for P/D of 1/1, 2/1, 1/2 and 2/2, side by side.

  python -m splitserve.bench.kv_transfer.tp_transfer                  # bench preset, 512/2048 tokens, 4 rounds
  python -m splitserve.bench.kv_transfer.tp_transfer --lengths 512 --rounds 1 --out /tmp/tp

One process, no Ray (bench/kv_transfer/tp_handoff.py): four real engines of the preset -- a
prefill and a decode engine of TP 1 and of TP 2, each TP-2 one with a spawned follower rank
running its KV plane -- paired every way, gloo over loopback. Each round sends one fresh prompt
(no prefix hit) per pairing, per length and per mode (layer-wise, packed), the pairings in a
rotated order, so load changes hit them alike. Per request: the bytes both sides' transports
counted, the prefill time (until the first token), the exposed transfer (prefill done -> every
decode rank holds its heads of every block) and the slowest prefill rank's sender time.
Writes results.md (the section of bench/results/tensor_parallel.md) and results.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from splitserve.bench import source_commit

COMMAND = ".venv/bin/python -m splitserve.bench.kv_transfer.tp_transfer"
PAIRINGS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (prefill TP, decode TP)
MODES = {"layer-wise": True, "packed": False}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.bench.kv_transfer.tp_transfer",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--preset", default="bench", choices=["tiny", "small", "bench"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[512, 2048], help="prompt lengths (tokens)")
    parser.add_argument("--rounds", type=int, default=4, help="requests per pairing, length and mode")
    parser.add_argument(
        "--out", default="bench/results/tensor_parallel/transfer", help="directory for results.{md,json} (untracked)"
    )
    args = parser.parse_args(argv)
    if any(n < 16 for n in args.lengths) or args.rounds < 1:
        parser.error("lengths must be >= 16 tokens and --rounds >= 1")
    return args


def measure(args: argparse.Namespace, workdir: str) -> dict:
    import torch

    from splitserve.bench.kv_transfer.tp_handoff import Replica, handoff, pair
    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    torch.set_num_threads(1)
    model = str(write_random_checkpoint(Path(workdir) / args.preset, preset=args.preset))
    blocks = 4 * max(-(-n // 16) for n in args.lengths)
    engine = {"num_kv_blocks": blocks, "max_model_len": max(args.lengths) + 16}
    prefill = {tp: Replica(f"p{tp}", model, tp, **engine) for tp in (1, 2)}
    decode = {tp: Replica(f"d{tp}", model, tp, **engine) for tp in (1, 2)}
    vocab = prefill[1].engine.model_config.vocab_size
    rng = random.Random(0)
    samples: dict[str, list[dict]] = {}
    load_before = os.getloadavg()
    started = time.time()
    try:
        for p, d in PAIRINGS:
            pair(prefill[p], decode[d])
        for round_index in range(args.rounds):
            for length in args.lengths:
                for mode, layerwise in MODES.items():
                    shift = round_index % len(PAIRINGS)
                    for p, d in PAIRINGS[shift:] + PAIRINGS[:shift]:
                        prompt = [rng.randrange(16, vocab) for _ in range(length)]
                        result = handoff(prefill[p], decode[d], prompt, 2, layerwise)
                        assert result.cached_blocks == 0 and result.bytes_sent == result.bytes_received
                        samples.setdefault(f"{p}/{d}|{length}|{mode}", []).append(
                            {
                                "bytes": result.bytes_received,
                                "prefill_s": result.prefill_s,
                                "exposed_s": result.exposed_s,
                                "sender_s": result.sender_s,
                            }
                        )
                print(f"round {round_index + 1}/{args.rounds}: {length} tokens done", file=sys.stderr)
    finally:
        for replica in (*prefill.values(), *decode.values()):
            replica.close()
    return {
        "preset": args.preset,
        "samples": samples,
        "wall_s": time.time() - started,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "commit": source_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def report(results: dict, args: argparse.Namespace) -> str:
    lines = [
        "## Heterogeneous KV transfer",
        "",
        f"Command (repo root): `{COMMAND}` -- {results['wall_s']:.0f} s wall.",
        "",
        f"{results['commit']}.",
        "",
        f"Machine: 2 CPU cores shared with other jobs (load average {results['load_before'][0]:.1f} before, "
        f"{results['load_after'][0]:.1f} after), no GPU; gloo over loopback; torch {results['torch']}, Python "
        f"{results['python']}; 1 torch thread per rank; fp32 KV, 16-token blocks; the `{results['preset']}` preset "
        "(4 KV heads of 64, 2 layers). Other work shared the machine: each round runs every pairing once, in a "
        "rotated order, and the tables give medians and ratios to 1/1 measured in the same rounds.",
        "",
        "One process, no Ray (`bench/kv_transfer/tp_handoff.py`): a prefill and a decode engine of TP 1 and of "
        "TP 2 (each TP-2 engine's second rank a spawned process with its own KV plane), paired every way, the "
        "workers' handoff (decode posts its receives, prefill sends each layer as it is done or all after the "
        "step). bytes = what the decode ranks' transports received (equal, checked, to what the prefill ranks' "
        "sent); prefill = the prefill engine's steps until the first token; exposed = prefill done -> every "
        "decode rank holds its heads of every block; sender = the slowest prefill rank's sender busy time.",
        "",
        "| P/D TP | tokens | send | requests | bytes / request | bytes vs 1/1 | prefill ms | exposed ms "
        "| exposed vs 1/1 | sender ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    samples = results["samples"]
    for length in args.lengths:
        for mode in MODES:
            base = samples[f"1/1|{length}|{mode}"]
            base_bytes = statistics.median(s["bytes"] for s in base)
            base_exposed = statistics.median(s["exposed_s"] for s in base)
            for p, d in PAIRINGS:
                rows = samples[f"{p}/{d}|{length}|{mode}"]
                num_bytes = statistics.median(s["bytes"] for s in rows)
                exposed = statistics.median(s["exposed_s"] for s in rows)
                lines.append(
                    f"| {p}/{d} | {length} | {mode} | {len(rows)} | {num_bytes / 2**20:.2f} MiB "
                    f"| **{num_bytes / base_bytes:.2f}** | {statistics.median(s['prefill_s'] for s in rows) * 1e3:.1f} "
                    f"| {exposed * 1e3:.2f} | **{exposed / base_exposed:.2f}** "
                    f"| {statistics.median(s['sender_s'] for s in rows) * 1e3:.2f} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="splitserve-tp-transfer-") as workdir:
        results = measure(args, workdir)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = report(results, args)
    (out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
