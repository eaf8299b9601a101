"""Markdown, loss-curve PNG and raw JSON (not committed) for bench/models/trained_model.py."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from splitserve.bench import cpu_model, require_extra

KINDS = ("continue", "quote", "shuffled quote")


def _moving_average(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_losses(result: dict, path: Path) -> None:
    matplotlib = require_extra("matplotlib")
    matplotlib.use("Agg")
    plt = require_extra("matplotlib.pyplot")

    fig, ax = plt.subplots(figsize=(7, 4))
    for role, color in (("target", "tab:blue"), ("draft", "tab:orange")):
        losses = result["training"][role]["losses"]
        steps = range(1, len(losses) + 1)
        label = result["specs"][role]
        ax.plot(steps, losses, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, _moving_average(losses, 20), color=color, label=f"{label} (20-step mean)")
    ax.set_yscale("log")
    ax.set_xlabel("AdamW step (batch 8 x 128 tokens)")
    ax.set_ylabel("causal-LM loss (nats/token)")
    ax.set_title("make-model --train-steps on the built-in corpus (CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tail_mean(losses: list[float], n: int = 20) -> float:
    tail = losses[-n:]
    return sum(tail) / len(tail)


def _rows(result: dict):
    for role in ("target", "draft"):
        for state in ("random", "trained"):
            steps = result["training"][role]["steps"]
            weights = "random" if state == "random" else f"trained {steps} steps"
            yield role, state, f"| {role} ({result['presets'][role]}) | {weights}"


def render(result: dict, png_name: str) -> str:
    lines = [
        "# Briefly trained checkpoints: loss, cost, n-gram hit rate before vs after",
        "",
        f"{result['commit']}. Command (from the repo root):",
        "",
        "```",
        shlex.join(result["argv"]),
        "```",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} CPUs shared with other "
        f"jobs (load average {result['load_before'][0]:.1f} at start, {result['load_after'][0]:.1f} at end), "
        "no GPU. Training uses one torch thread. Wall time on this shared machine mostly measures the "
        "neighbours; CPU seconds are what the same run costs on an idle one.",
        "",
        "## Training",
        "",
        f"![loss curve]({png_name})",
        "",
        "| model | parameters | steps | tokens seen | loss first step | loss last 20 steps | wall s | CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for role in ("target", "draft"):
        t = result["training"][role]
        lines.append(
            f"| {result['specs'][role]} | {result['params'][role] / 1e6:.2f} M | {t['steps']} | "
            f"{t['tokens_seen']:,} | {t['losses'][0]:.2f} | {_tail_mean(t['losses']):.2f} | "
            f"{t['wall_s']:.0f} | {t['cpu_s']:.0f} |"
        )
    recipe = result["training"]["target"]["recipe"]
    lines += [
        "",
        "Recipe (`engine/builtin_models/corpus_training.py`): "
        + ", ".join(f"{k}={v}" for k, v in recipe.items())
        + ". Rows are corpus windows or, with probability copy_fraction, a span and its repeats "
        'after "\\n\\n" (`engine/builtin_models/corpus_batches.py`). Training time is what `training.json` '
        "in the checkpoint recorded when it was made (a cached checkpoint keeps its original timing).",
        "",
        "## Greedy output on corpus-like prompts",
        "",
        f"{result['num_prompts']} prompts per kind, {result['max_new_tokens']} greedy tokens each, EOS "
        "ignored; `continue` = a passage's first 24 tokens, `quote` = 64 tokens of a passage, "
        '"\\n\\n" and its first 4 tokens again, `shuffled quote` = the same with corpus words in a '
        "random order. **n-gram hit rate**: the next token equals the prompt-lookup guess (longest "
        "recent match of the last 3..1 tokens in prompt + output; `bench/models/prompt_lookup.py`). "
        "**exact**: the token equals the reference at the same position (the passage's real "
        "continuation / the quoted text). **corpus 4-grams**: share of the output's token 4-grams "
        "found in the corpus.",
        "",
        "| model | weights | " + " | ".join(f"{k}: n-gram hit rate" for k in KINDS) + " |",
        "|---|---|" + "---|" * len(KINDS),
    ]
    for role, state, label in _rows(result):
        s = result["scores"][f"{role}/{state}"]
        lines.append(f"{label} | " + " | ".join(f"{s[k]['hit_rate']:.3f}" for k in KINDS) + " |")
    lines += [
        "",
        "| model | weights | " + " | ".join(f"{k}: exact | {k}: corpus 4-grams" for k in KINDS) + " |",
        "|---|---|" + "---|---|" * len(KINDS),
    ]
    for role, state, label in _rows(result):
        s = result["scores"][f"{role}/{state}"]
        cells = " | ".join(f"{s[k]['exact']:.3f} | {s[k]['corpus_4grams']:.3f}" for k in KINDS)
        lines.append(f"{label} | {cells} |")
    agree = result["draft_agreement"]
    lines += [
        "",
        f"Draft agreement with the trained target's greedy tokens (all kinds): random draft "
        f"{agree['random']:.3f}, trained draft {agree['trained']:.3f}.",
        "",
        "## Samples (target, greedy)",
        "",
    ]
    for state in ("random", "trained"):
        for text in result["samples"][state]:
            lines.append(f"- {state}: `{text!r}`")
    return "\n".join(lines) + "\n"


def write_report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_name(out.stem + "_loss.png")
    plot_losses(result, png)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.write_text(render(result, png.name))
