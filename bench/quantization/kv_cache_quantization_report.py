"""The held-out text and the markdown write-up of bench/quantization/kv_cache_quantization.py."""

from __future__ import annotations

import platform
import shlex
import sys

# Written for this benchmark (not in engine/builtin_models/corpus.py, the training corpus): English
# prose of the kind the model saw, so perplexity measures the model rather than a new alphabet.
HELD_OUT = [
    "The lighthouse keeper walked up the narrow stairs every evening, counting the steps as his "
    "father had done before him, and when he reached the lamp room he wiped the glass with a soft "
    "cloth and looked out over the grey water to see whether any ship was near the rocks.",
    "In the spring the farmers of the valley met in the old church hall to decide how the water "
    "of the river should be shared, and though they argued long into the night, each of them knew "
    "that the harvest of the whole valley depended on the agreement they would reach.",
    "She opened the letter slowly, for she had waited many weeks for news from her brother, and as "
    "she read the first lines she understood that he was well, that the journey had been hard, and "
    "that he would not return home before the winter came.",
    "A good teacher does not only speak of what is known; she shows her students how a question is "
    "asked, how an answer is tested, and how a mind may change when the evidence is clear, and "
    "these lessons stay with them long after the facts are forgotten.",
    "The city was quiet in the early morning, the shops still closed and the streets wet from the "
    "rain, and only the baker on the corner was at work, his windows bright with light and the smell "
    "of fresh bread drifting out into the empty square.",
]


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def write_report(args, results: dict, commit: str) -> None:
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    (l1, _, _), (l2, _, _) = results["load"]
    out = [
        "# fp8 / int8 KV cache on the trained small model",
        "",
        f"{commit}. Command (from the repo root):",
        "",
        "```",
        f"python -m splitserve.bench.quantization.kv_cache_quantization {argv}".rstrip(),
        "```",
        "",
        f"Machine: {platform.processor() or platform.machine()}, CPU only, one torch thread, shared with other "
        f"jobs while measuring (load average {l1:.1f} at start, {l2:.1f} at end). Model: the `small` preset "
        "trained 300 steps (`small-llama-trained300`, float32 weights, 4 layers, 2 KV heads, head_dim 64).",
        "",
        "## Scale granularity: attention error on real activations",
        "",
        "Every layer's queries, keys and values from the engine's prefill of the held-out text; K and V "
        "quantized each way, causal attention over them against fp32 attention over the originals "
        "(relative error ||out_q - out|| / ||out||, mean over layers and texts).",
        "",
    ]
    rows = []
    for (kv, scheme), r in results["granularity"].items():
        name = "per (token, head), float16 scale" if scheme == "token" else "per (block of 16, head), float32 scale"
        rows.append(
            [kv, name, f"{r['bytes_per_value']:.4f}", f"{r['keys']:.4f}", f"{r['values']:.4f}", f"{r['attention']:.4f}"]
        )
    out += _table(["KV dtype", "scales", "bytes / value", "K rel. error", "V rel. error", "attention rel. error"], rows)
    quality = results["quality"]
    out += [
        "",
        "## Quality through the engine",
        "",
        f"Perplexity over the {quality['auto']['tokens']} held-out prompt tokens (text written for this benchmark) "
        f"and, for contrast, over the {quality['auto']['corpus_tokens']} tokens of the training corpus's English "
        "passages (in distribution: this 4 M-parameter model has memorised its small corpus and generalises "
        "little, so held-out perplexity is huge and its logits are extreme), from the engine's prompt "
        f"log-probabilities (`prompt_logprobs`, as an eval harness reads them); greedy agreement: {quality['auto']['num_prompts']} prompts (24-token starts of the "
        f"corpus passages and of the held-out texts), {args.max_new_tokens} greedy tokens each, EOS ignored, the "
        "fraction of positions equal to the auto cache's output (after a first difference the texts drift apart, "
        "so this is a strict measure).",
        "",
    ]
    rows = [
        [
            kv,
            f"{r['ppl']:.1f}",
            f"{100 * r['dppl']:+.2f} %",
            f"{r['corpus_ppl']:.4f}",
            f"{100 * r['corpus_dppl']:+.2f} %",
            f"{r['agreement']:.3f}",
            f"{r['identical']}/{r['num_prompts']}",
        ]
        for kv, r in quality.items()
    ]
    header = ["KV dtype", "held-out perplexity", "Δ vs auto", "corpus perplexity", "Δ vs auto"]
    out += _table([*header, "greedy agreement", "identical outputs"], rows)
    out += ["", "## Capacity: KV blocks per GiB (block = 16 tokens, all 4 layers, K and V, scales included)", ""]
    cap = results["capacity"]
    base = cap["auto (bfloat16)"]["blocks_per_gib"]
    rows = [
        [n, c["bytes_per_block"], c["blocks_per_gib"], c["blocks_per_gib"] * 16, f"{c['blocks_per_gib'] / base:.2f}x"]
        for n, c in cap.items()
    ]
    out += _table(["KV cache", "bytes / block", "blocks / GiB", "tokens / GiB", "vs bfloat16"], rows)
    handoff = results["handoff"]
    bf16 = handoff["auto (bfloat16)"]
    out += [
        "",
        f"## Bytes per prefill -> decode handoff at {args.handoff_tokens} tokens",
        "",
        "KVSender -> PostedReceive over a real gloo pair in one process, layer-wise, "
        f"{args.handoff_tokens // 16} blocks; bytes from the sending transport's TransferStats counter.",
        "",
    ]
    rows = [
        [n, b, f"{b / 2**20:.2f}", f"{b / bf16:.3f}x", f"{b / handoff['auto (float32)']:.3f}x"]
        for n, b in handoff.items()
    ]
    out += _table(["KV cache", "bytes", "MiB", "vs bfloat16", "vs float32"], rows)
    speed = results["speed"]
    out += [
        "",
        f"## Decode speed on this CPU (colocated engine, {args.speed_tokens} new tokens per request, "
        f"16-token prompts, best of {args.speed_reps} interleaved runs)",
        "",
    ]
    rows = []
    for batch in sorted({b for _, b in speed}):
        auto, fp8 = speed["auto", batch], speed["fp8", batch]
        rows.append([batch, f"{auto:.1f}", f"{fp8:.1f}", f"{fp8 / auto:.2f}x"])
    out += _table(["batch", "auto (float32 KV) tok/s", "fp8 KV tok/s", "fp8 / auto"], rows)
    out.append("")
    args.out.write_text("\n".join(out))
