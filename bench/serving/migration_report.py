"""bench/serving/migration.py's numbers: what a client saw per stream, the phases' TTFT and ITL,
the moves' gaps and recomputed tokens, the replacements; a markdown table and a timeline plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from splitserve.bench.loadgen.metrics import LatencySummary


@dataclass
class Stream:
    """One streamed completion as its client saw it (times: seconds since the load started)."""

    label: str
    prompt: list[int]
    sent_s: float = 0.0
    end_s: float = 0.0
    status: int | None = None
    error: str | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens in it)
    text: str = ""
    finish: str | None = None
    usage_tokens: int | None = None

    def completed(self, max_tokens: int) -> bool:
        """One whole answer: no error, every token (counted and in usage), ended by length."""
        num_tokens = sum(n for _, n in self.chunks)
        return (
            self.error is None
            and self.status == 200
            and self.finish == "length"
            and num_tokens == max_tokens
            and self.usage_tokens == max_tokens
        )

    def gaps(self) -> list[tuple[float, float]]:
        """(arrival of the later chunk, gap since the one before) for each pair of chunks."""
        return [(b, b - a) for (a, _), (b, _) in zip(self.chunks, self.chunks[1:])]

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["prompt"], out["text"]  # the raw dump stays small; the run re-creates both
        return out


def _ms(summary: LatencySummary) -> dict:
    return {k: (None if v is None else round(1000 * v, 1)) for k, v in (("p50", summary.p50), ("p99", summary.p99))}


def _pct(values: list[float]) -> dict:
    s = LatencySummary.of(values)
    return {"n": s.count, "mean": s.mean, "p50": s.p50, "p99": s.p99}


def summarize(run: dict, args) -> dict:
    """The numbers the write-up quotes, for one configuration."""
    streams = [s if isinstance(s, Stream) else Stream(**s, prompt=[]) for s in run["streams"]]
    split = args.baseline_s
    done = [s for s in streams if s.completed(args.max_tokens)]
    errors: dict[str, int] = {}
    for s in streams:
        if not s.completed(args.max_tokens):
            kind = (s.error or f"finish={s.finish} tokens={sum(n for _, n in s.chunks)}").split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    phases = {}
    for phase, inside in (("baseline", lambda t: t < split), ("failures", lambda t: t >= split)):
        ttft = [s.chunks[0][0] - s.sent_s for s in done if s.chunks and inside(s.sent_s)]
        itl = [gap for s in done for at, gap in s.gaps() if inside(at)]
        phases[phase] = {"ttft_ms": _ms(LatencySummary.of(ttft)), "itl_ms": _ms(LatencySummary.of(itl))}
    ratio = {
        metric: (phases["failures"][metric]["p99"] or 0) / phases["baseline"][metric]["p99"]
        if phases["baseline"][metric]["p99"]
        else None
        for metric in ("ttft_ms", "itl_ms")
    }
    moved = set(run["moved_labels"])
    client_gaps = [max(g for _, g in s.gaps()) for s in done if s.label in moved and len(s.chunks) > 1]
    carried = [n for _, n in run["moves"]]
    detect, resume = move_stages(run, {s.label: s for s in streams})
    replaced = []
    for kill in run["kills"]:
        back = [t for t, ids in run["pool_samples"] if t > kill["at_s"] and kill["victim"] not in ids]
        full = [t for t, ids in run["pool_samples"] if back and t >= back[0] and len(ids) == args.decode_replicas]
        replaced.append(round(full[0] - kill["at_s"], 1) if full else None)
    return {
        "name": run["name"],
        "host_tier_gib": run["host_tier_gib"],
        "start_s": round(run["start_s"], 1),
        "capacity_tokens_per_s": run["capacity_tokens_per_s"],
        "rate_rps": run["rate_rps"],
        "streams": len(streams),
        "completed": len(done),
        "completed_share": len(done) / len(streams) if streams else None,
        "errors": errors,
        "kills": len(run["kills"]),
        "streams_on_victims": sum(k["streams"] for k in run["kills"]),
        "moves": len(run["moves"]),
        "retries": run.get("retries"),
        "moves_by_reason": {r: sum(1 for m, _ in run["moves"] if m == r) for r in {m for m, _ in run["moves"]}},
        "refusals": run["refusals"],
        "gap_s": _pct(run["gap_s"]),
        "client_gap_s": _pct(client_gaps),
        "carried_tokens": _pct(carried),
        "recomputed_tokens": _pct(run["recomputed_tokens"]),
        "kill_to_move_s": _pct(detect),
        "move_to_next_token_s": _pct(resume),
        "phases": phases,
        "p99_ratio_failures_to_baseline": ratio,
        "replaced_after_s": replaced,
        "baseline": {k: run["baseline"][k] for k in ("ok", "after_s", "busy", "stale_routed", "live_decode")},
        "host_stored_loaded_blocks": run["baseline"]["host_stored_loaded_blocks"],
        "verify": run["verify"],
    }


def move_stages(run: dict, by_label: dict[str, Stream]) -> tuple[list[float], list[float]]:
    """Per move, the ingress's part of the gap: from the kill to the dispatcher re-submitting
    the stream (the failure reaching it), and from there to the client's next token (routing,
    prefill of the continuation, KV transfer, the new replica's first step)."""
    detect, resume = [], []
    for label, moved_at in run.get("move_log", []):
        kills = [k["at_s"] for k in run["kills"] if k["at_s"] <= moved_at]
        after = [at for at, _ in by_label[label].chunks if at > moved_at] if label in by_label else []
        if kills and after:
            detect.append(moved_at - kills[-1])
            resume.append(after[0] - moved_at)
    return detect, resume


def _f(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(summaries: list[dict]) -> str:
    """The side-by-side table (one column per configuration)."""
    rows = [
        (
            "streams completed",
            lambda s: f"{s['completed']} / {s['streams']} ({100 * (s['completed_share'] or 0):.1f}%)",
        ),
        (
            "kills / streams on the victims / moves",
            lambda s: f"{s['kills']} / {s['streams_on_victims']} / {s['moves']}",
        ),
        ("retried before a first token / refused moves", lambda s: f"{s['retries']} / {len(s['refusals'])}"),
        (
            "gap at a move p50 / p99 (ingress), ms",
            lambda s: f"{_f(_k(s['gap_s'], 'p50'))} / {_f(_k(s['gap_s'], 'p99'))}",
        ),
        (
            "largest gap of a moved stream p50 / p99 (client), ms",
            lambda s: f"{_f(_k(s['client_gap_s'], 'p50'))} / {_f(_k(s['client_gap_s'], 'p99'))}",
        ),
        (
            "of which kill -> re-submitted / -> next token p50, ms",
            lambda s: f"{_f(_k(s['kill_to_move_s'], 'p50'))} / {_f(_k(s['move_to_next_token_s'], 'p50'))}",
        ),
        ("output tokens carried per move, mean", lambda s: _f(s["carried_tokens"]["mean"])),
        (
            "tokens recomputed per move, mean / p50 / p99",
            lambda s: " / ".join(_f(s["recomputed_tokens"][k]) for k in ("mean", "p50", "p99")),
        ),
        ("TTFT p99 ms, baseline / failures", lambda s: _pair(s, "ttft_ms")),
        ("ITL p99 ms, baseline / failures", lambda s: _pair(s, "itl_ms")),
        ("TTFT p50 ms, baseline / failures", lambda s: _pair(s, "ttft_ms", "p50")),
        ("ITL p50 ms, baseline / failures", lambda s: _pair(s, "itl_ms", "p50")),
        (
            "p99 failures / baseline: TTFT, ITL",
            lambda s: ", ".join(_f(s["p99_ratio_failures_to_baseline"][m], 2) for m in ("ttft_ms", "itl_ms")),
        ),
        ("replacement back in the pool after kill, s", lambda s: ", ".join(_f(v) for v in s["replaced_after_s"])),
        ("pools at baseline afterwards", lambda s: f"{s['baseline']['ok']} ({s['baseline']['after_s']:.1f} s)"),
        (
            "moved / unmoved streams re-sent alone: equal text",
            lambda s: " / ".join(f"{v['equal']}/{v['checked']}" for v in s["verify"].values()),
        ),
    ]
    out = ["| | " + " | ".join(s["name"] for s in summaries) + " |", "|---" * (len(summaries) + 1) + "|"]
    out += [f"| {label} | " + " | ".join(cell(s) for s in summaries) + " |" for label, cell in rows]
    return "\n".join(out)


def _k(stats: dict, key: str):
    return None if stats[key] is None else 1000 * stats[key]


def _pair(s: dict, metric: str, stat: str = "p99") -> str:
    return f"{_f(s['phases']['baseline'][metric][stat])} / {_f(s['phases']['failures'][metric][stat])}"


def plot(runs: list[dict], args, path: Path) -> None:
    """Per configuration: ITL p99 per 2-s bin and each request's TTFT over time, the kills, and
    the live decode replicas."""
    from splitserve.bench.loadgen.plots import plt

    figure, axes = plt.subplots(len(runs), 1, figsize=(11, 3.4 * len(runs)), sharex=True, squeeze=False)
    for axis, run in zip(axes[:, 0], runs):
        streams = [Stream(**s, prompt=[]) for s in run["streams"]]
        bins: dict[int, list[float]] = {}
        for s in streams:
            for at, gap in s.gaps():
                bins.setdefault(int(at // 2), []).append(gap)
        xs = sorted(bins)
        axis.plot(
            [2 * x + 1 for x in xs], [1000 * LatencySummary.of(bins[x]).p99 for x in xs], label="ITL p99 (2-s bins)"
        )
        axis.scatter(
            [s.sent_s for s in streams if s.chunks],
            [1000 * (s.chunks[0][0] - s.sent_s) for s in streams if s.chunks],
            s=4,
            color="tab:orange",
            label="TTFT per request",
        )
        for i, kill in enumerate(run["kills"]):
            axis.axvline(kill["at_s"], color="tab:red", linestyle="--", linewidth=1, label="kill" if i == 0 else None)
        axis.axvline(args.baseline_s, color="gray", linewidth=1)
        axis.set_yscale("log")
        axis.set_ylabel("ms")
        axis.set_title(f"{run['name']}: {run['rate_rps']:.2f} req/s")
        twin = axis.twinx()
        twin.step(
            [t for t, _ in run["pool_samples"]],
            [len(ids) for _, ids in run["pool_samples"]],
            where="post",
            color="tab:green",
            label="live decode replicas",
        )
        twin.set_ylim(0, args.decode_replicas + 1)
        twin.set_ylabel("decode replicas")
        lines, labels = axis.get_legend_handles_labels()
        more, more_labels = twin.get_legend_handles_labels()
        axis.legend(lines + more, labels + more_labels, loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since the open loop started (gray: failures start)")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
