"""TP 1 against TP 2 decode step time on this CPU, and where a TP-2 step goes: the runs behind
bench/results/tensor_parallel.md's "Step time" section.

  python -m splitserve.bench.engine.tp_step_time [--repeats 3] [--max-tokens 16] [--out FILE]

One process (rank 0 of the TP-2 engine; its follower a spawned process), the `bench` preset
(`splitserve make-model --preset bench`: hidden 256, 2 layers, 4 heads), fp32, greedy, ignore_eos,
16-token prompts, batches of 1, 8 and 32. A decode step is (t(N tokens) - t(1 token)) / (N - 1)
with fresh prompts, so prefill drops out. Four engines interleave per repeat: TP 1 with the
scripted CPU decode step (the default), TP 1 eager, TP 2 eager with its collectives over shared
memory (the default, engine/parallel/shm_collectives.py) and TP 2 eager all on gloo
(tensor_parallel_shm_collectives=False). TP refuses the scripted step (one TorchScript call
leaves no place for the collectives), so TP 1 eager against TP 2 is the like-for-like pair.

Where rank 0's step goes, timed around the calls in this process only (the follower is not
patched): `collectives` = the all-reduces (row-parallel outputs; the embedding's where it is
vocabulary-parallel) and the logits gather; `broadcast` = handing the step to the follower: with
the collectives over shared memory, its forward and batch written to the step mailbox
(engine/parallel/step_mailbox.py); on gloo, the command over its pipe and the batch (ids,
positions, slots, block tables) broadcast on the group (a decode step's logits go out with its
forward: no command or hidden-rows broadcast of their own). A collective's time
includes waiting for the slower rank, which is what the step pays for it; `waiting` is that part
of both over shared memory (rank 0 waiting for rank 1's counters), which gloo does not show.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

BATCHES = (1, 8, 32)
KINDS = ("collectives", "broadcast", "waiting")
ENGINES = ("TP 1, scripted step", "TP 1, eager", "TP 2, eager", "TP 2, eager, gloo")


class StepClock:
    """Seconds rank 0 spent in each kind of call, accumulated (patched around the TP classes)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, kind: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[kind] += time.perf_counter() - started

        setattr(owner, name, timed)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


def install_clock() -> StepClock:
    from splitserve.engine.parallel.shm_collectives import ShmCollectives
    from splitserve.engine.parallel.tp_group import TensorParallelGroup
    from splitserve.engine.parallel.tp_ranks import TensorParallelRanks

    clock = StepClock()
    clock.wrap(ShmCollectives, "wait_for", "waiting")
    clock.wrap(TensorParallelGroup, "all_reduce", "collectives")
    clock.wrap(TensorParallelGroup, "gather_to_driver", "collectives")
    clock.wrap(TensorParallelGroup, "broadcast", "broadcast")
    clock.wrap(TensorParallelRanks, "_send", "broadcast")
    clock.wrap(TensorParallelRanks, "_post", "broadcast")  # a CPU group's forward: the step mailbox
    return clock


def build_engine(model: Path, name: str):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.llm_engine import LLMEngine

    # The decode forward is chosen when the model loads (engine/model/scripted_decode.py).
    os.environ["SPLITSERVE_CPU_DECODE_FORWARD"] = "scripted" if "scripted" in name else "eager"
    tp = 2 if name.startswith("TP 2") else 1
    config = EngineConfig(
        model=str(model),
        num_kv_blocks=1024,
        max_num_seqs=64,
        tensor_parallel_size=tp,
        tensor_parallel_shm_collectives="gloo" not in name,
    )
    return LLMEngine(config)


def decode_step(engine, clock: StepClock, batch: int, max_tokens: int, rng: random.Random) -> dict[str, float]:
    """ms per decode step, and rank 0's ms per step in collectives and in the broadcast."""
    from splitserve.proto.messages.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    wall, spent = [], []
    for tokens in (1, max_tokens):
        prompts = [[rng.randrange(16, vocab) for _ in range(16)] for _ in range(batch)]
        before, started = clock.snapshot(), time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        wall.append(time.perf_counter() - started)
        after = clock.snapshot()
        spent.append({kind: after.get(kind, 0.0) - before.get(kind, 0.0) for kind in KINDS})
    steps = max_tokens - 1
    row = {"step_ms": (wall[1] - wall[0]) / steps * 1000}
    for kind in KINDS:
        row[f"{kind}_ms"] = max(spent[1][kind] - spent[0][kind], 0.0) / steps * 1000
    return row


def run(repeats: int, max_tokens: int, work: Path) -> dict[str, dict[int, dict[str, float]]]:
    import torch

    from splitserve.engine.builtin_models.make_model import write_random_checkpoint

    torch.set_num_threads(1)  # rank 0's; the follower gets its own share (rank_cpus.threads_per_rank)
    model = write_random_checkpoint(work / "bench", preset="bench", arch="llama")
    clock = install_clock()
    engines = {name: build_engine(model, name) for name in ENGINES}
    samples: dict[str, dict[int, list[dict[str, float]]]] = {n: defaultdict(list) for n in ENGINES}
    rng = random.Random(0)
    for repeat in range(repeats):
        order = ENGINES[repeat % len(ENGINES) :] + ENGINES[: repeat % len(ENGINES)]  # load drifts over all alike
        for name in order:
            for batch in BATCHES:
                samples[name][batch].append(decode_step(engines[name], clock, batch, max_tokens, rng))
    for engine in engines.values():
        engine.close()
    return {
        name: {batch: {key: statistics.median(s[key] for s in rows) for key in rows[0]} for batch, rows in per.items()}
        for name, per in samples.items()
    }


def _share(row: dict[str, float], kind: str) -> str:
    return f"{row[kind]:.2f} ({row[kind] / row['step_ms']:.0%})"


def report(results: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = [
        "| engine | batch | ms / step | vs TP 1 eager | collectives ms (share) | broadcast ms (share) | of which waiting ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, per in results.items():
        for batch, row in sorted(per.items()):
            base = results["TP 1, eager"][batch]["step_ms"]
            tp, shm = name.startswith("TP 2"), "gloo" not in name
            waiting = f"{row['waiting_ms']:.2f}" if tp and shm else "-"
            lines.append(
                f"| {name} | {batch} | {row['step_ms']:.2f} | {row['step_ms'] / base:.2f} | "
                f"{_share(row, 'collectives_ms') if tp else '-'} | {_share(row, 'broadcast_ms') if tp else '-'} | "
                f"{waiting} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", help="write the medians here as JSON too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        results = run(args.repeats, args.max_tokens, Path(work))
    print(report(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
