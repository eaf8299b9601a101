"""Replay of a Mooncake-style JSONL trace.

Each line holds `timestamp` (ms), `input_length`, `output_length` and `hash_ids`. A hash id
stands for one block of shared content (512 tokens in the Mooncake traces): equal hash ids at the
start of two requests mean equal prompt prefix tokens. Block tokens are a pure function of
(seed, hash id), so the replay reproduces the trace's prefix sharing exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench.loadgen.records import BenchRequest, WorkloadError
from splitserve.bench.loadgen.workloads import VocabRange


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.timestamp_ms < 0:
            raise WorkloadError(f"timestamp must be >= 0, got {self.timestamp_ms}")
        if self.input_length < 1 or self.output_length < 1:
            raise WorkloadError("input_length and output_length must be >= 1")
        if any(h < 0 for h in self.hash_ids):
            raise WorkloadError("hash_ids must be non-negative integers")


def load_mooncake_trace(path: str | Path, max_records: int | None = None) -> list[TraceRecord]:
    """Parse a JSONL trace; blank lines are skipped, bad lines raise WorkloadError with the line."""
    records: list[TraceRecord] = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                records.append(
                    TraceRecord(
                        timestamp_ms=float(row.get("timestamp", 0)),
                        input_length=int(row["input_length"]),
                        output_length=int(row["output_length"]),
                        hash_ids=tuple(int(h) for h in row.get("hash_ids", [])),
                    )
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise WorkloadError(f"{path}:{line_number}: bad trace line: {exc}") from exc
            if max_records is not None and len(records) >= max_records:
                break
    if not records:
        raise WorkloadError(f"{path}: trace has no records")
    return records


@dataclass(frozen=True)
class TraceWorkload:
    """Requests from trace records.

    Prompt lengths are scaled by block_size / trace_block_size, so a smaller `block_size` shrinks
    the whole trace for a small model while keeping which requests share which blocks. A prompt is
    its blocks' tokens, cut to the scaled input length (or padded with request-unique tokens when
    the blocks are shorter), then capped at `max_prompt_tokens`. Arrival offsets are the trace
    timestamps relative to the first, divided by `speedup`.
    """

    records: tuple[TraceRecord, ...]
    block_size: int = 512
    trace_block_size: int = 512
    speedup: float = 1.0
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    vocab: VocabRange = VocabRange()
    kind: str = dataclasses.field(default="trace", init=False)

    def __post_init__(self) -> None:
        if not self.records:
            raise WorkloadError("trace workload needs at least one record")
        if self.block_size < 1 or self.trace_block_size < 1:
            raise WorkloadError("block_size and trace_block_size must be >= 1")
        if not self.speedup > 0:
            raise WorkloadError(f"speedup must be > 0, got {self.speedup}")
        for name in ("max_prompt_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise WorkloadError(f"{name} must be >= 1 when set, got {value}")

    def prompt_len(self, record: TraceRecord) -> int:
        scaled = max(1, math.ceil(record.input_length * self.block_size / self.trace_block_size))
        return scaled if self.max_prompt_tokens is None else min(scaled, self.max_prompt_tokens)

    def output_len(self, record: TraceRecord) -> int:
        if self.max_output_tokens is None:
            return record.output_length
        return min(record.output_length, self.max_output_tokens)

    def block_tokens(self, seed: int, hash_id: int) -> list[int]:
        # Tag 0 = shared block content, tag 1 = per-request padding: the streams never collide.
        return self.vocab.sample(np.random.default_rng([seed, 0, hash_id]), self.block_size)

    def generate(self, seed: int) -> list[BenchRequest]:
        start_ms = min(record.timestamp_ms for record in self.records)
        blocks: dict[int, list[int]] = {}
        requests = []
        for index, record in enumerate(self.records):
            target = self.prompt_len(record)
            tokens: list[int] = []
            for hash_id in record.hash_ids:
                if len(tokens) >= target:
                    break
                if hash_id not in blocks:
                    blocks[hash_id] = self.block_tokens(seed, hash_id)
                tokens.extend(blocks[hash_id])
            if len(tokens) < target:
                pad_rng = np.random.default_rng([seed, 1, index])
                tokens.extend(self.vocab.sample(pad_rng, target - len(tokens)))
            requests.append(
                BenchRequest(
                    request_id=f"trace{index}",
                    prompt_token_ids=tuple(tokens[:target]),
                    max_tokens=self.output_len(record),
                    arrival_offset_s=(record.timestamp_ms - start_ms) / 1000.0 / self.speedup,
                    group_id=f"hash{record.hash_ids[0]}" if record.hash_ids else None,
                )
            )
        return requests

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "num_records": len(self.records),
            "block_size": self.block_size,
            "trace_block_size": self.trace_block_size,
            "speedup": self.speedup,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
            "vocab": {"low": self.vocab.low, "high": self.vocab.high},
        }
