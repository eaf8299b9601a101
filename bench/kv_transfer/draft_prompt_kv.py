"""Where should a draft model's prompt KV come from? Measures the option splitserve takes --
the decode replica prefills the prompt into the draft locally (DraftModelProposer) -- against
what shipping it from the prefill replica would add: the draft KV's bytes over the KV path.

For each prompt length: the median wall time of the draft's one-chunk prompt pass in the
decode process (DraftModelProposer._forward over the whole prompt, 1 torch thread), the draft
KV's size, and the time to move that many bytes at the KV path's measured bandwidth (read from
bench/results/kv_transfer.md's layer-wise rows: the median KV GB/s of that table). Shipping
would also need the draft loaded on every prefill replica and its pass computed there.

  python -m splitserve.bench.kv_transfer.draft_prompt_kv --draft DRAFT_DIR [--out bench/results/draft_prompt_kv.md]
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from splitserve.bench import RESULTS_DIR, source_commit

LENGTHS = (128, 512, 2048)
KV_TRANSFER_MD = RESULTS_DIR / "kv_transfer.md"


def kv_path_gbps(path: Path = KV_TRANSFER_MD) -> float:
    """Median 'KV GB/s' of the layer-wise rows of the committed KV transfer results."""
    rates = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 8 and cells[3] == "layer-wise" and re.fullmatch(r"[0-9.]+", cells[8]):
            rates.append(float(cells[8]))
    if not rates:
        raise ValueError(f"no layer-wise rows in {path}")
    return statistics.median(rates)


def measure(draft_dir: str, lengths=LENGTHS, repeats: int = 5) -> list[dict]:
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.core.sequence import Sequence
    from splitserve.engine.speculative.draft_model_proposer import DraftModelProposer
    from splitserve.proto.messages.sampling_params import SamplingParams

    torch.set_num_threads(1)
    block_size = 16
    config = EngineConfig(model=draft_dir, num_kv_blocks=max(lengths) // block_size + 2, block_size=block_size)
    vocab_size = vocab_size_of(draft_dir)
    proposer = DraftModelProposer(draft_dir, config, vocab_size)
    cache = proposer.kv_cache
    rows = []
    for length in lengths:
        seq = Sequence("r", [5 + i % (vocab_size - 5) for i in range(length)], SamplingParams(), block_size)
        seq.block_table = list(range(-(-length // block_size)))
        times = []
        with torch.inference_mode():
            for _ in range(repeats + 1):
                start = time.perf_counter()
                proposer._forward([seq], [0], [seq.token_ids])
                times.append(time.perf_counter() - start)
        kv_bytes = length * cache.bytes_per_block // block_size
        rows.append({"tokens": length, "prefill_ms": 1e3 * statistics.median(times[1:]), "kv_bytes": kv_bytes})
    return rows


def vocab_size_of(model_dir: str) -> int:
    from splitserve.engine.model_config import ModelConfig

    return ModelConfig.from_pretrained(Path(model_dir)).vocab_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", required=True, help="draft checkpoint directory")
    parser.add_argument("--out", type=Path, default=None, help="markdown report (default: print only)")
    parser.add_argument(
        "--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated prompt lengths (default %(default)s)"
    )
    args = parser.parse_args(argv)
    gbps = kv_path_gbps()
    rows = measure(args.draft, tuple(int(n) for n in args.lengths.split(",")))
    lines = [
        "# Draft prompt KV: prefill locally on decode vs ship it from prefill",
        "",
        f"Command: `python -m splitserve.bench.kv_transfer.draft_prompt_kv {shlex.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        source_commit(),
        "",
        f"Draft: `{Path(args.draft).name}`, fp32, 1 torch thread, CPU. Transfer time = bytes / {gbps:.2f} GB/s, the "
        "median layer-wise KV-path rate of `bench/results/kv_transfer.md` (gloo, loopback, this machine).",
        "",
        "| prompt tokens | local draft prefill ms (median of 5) | draft KV bytes | transfer ms at the KV path's rate |",
        "|---|---|---|---|",
    ]
    for r in rows:
        transfer_ms = r["kv_bytes"] / (gbps * 1e9) * 1e3
        lines.append(f"| {r['tokens']} | {r['prefill_ms']:.2f} | {r['kv_bytes']:,} | {transfer_ms:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
