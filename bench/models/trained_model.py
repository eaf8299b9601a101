"""What brief training on the corpus buys: loss curve, cost, and n-gram hit rate before vs after.

Trains (or takes from the model cache) the target preset and the draft preset with
`make-model --train-steps`, then compares each with its random-weight starting point on
corpus-like prompts, greedy, EOS ignored:

  continue        <s> + the first 24 tokens of a corpus passage
  quote           <s> + 64 tokens of a passage + "\\n\\n" + its first 4 tokens (the output should copy)
  shuffled quote  <s> + corpus words in a random order + "\\n\\n" + its first 4 tokens

  n-gram hit rate  fraction of output tokens equal to the prompt-lookup guess (longest recent
                   match of the last 3..1 tokens in prompt + output so far; no match = miss)
  exact            fraction of output tokens equal to the reference at the same position (the
                   passage's real continuation, or the quoted text), so loops that merely
                   repeat themselves do not look like learning
  corpus 4-grams   fraction of the output's token 4-grams that occur in the corpus: corpus-like
                   text even where a skipped phrase shifts every later position
  draft agreement  fraction of the target's greedy tokens the draft's argmax predicts on the
                   same prefix: the per-token greedy acceptance a draft proposer would see

  python -m splitserve.bench.models.trained_model                 # cached checkpoints when present
  python -m splitserve.bench.models.trained_model --fresh         # retrain both, to time it now
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from splitserve.bench import RESULTS_DIR, source_commit
from splitserve.bench.models.prompt_lookup import ngram_hit_rate
from splitserve.engine.builtin_models.corpus import PASSAGES
from splitserve.engine.builtin_models.make_model import TRAINING_FILE, ModelSpec, write_checkpoint
from splitserve.engine.builtin_models.model_cache import cached_checkpoint

DEFAULT_OUT = RESULTS_DIR / "trained_model.md"
KINDS = ("continue", "quote", "shuffled quote")
CONTINUE_PREFIX, QUOTE_LEN, CUE_LEN = 24, 64, 4


def corpus_prompts(tokenizer) -> dict[str, list[tuple[list[int], list[int]]]]:
    """kind -> [(prompt ids, reference continuation ids)], from the English passages."""
    bos = tokenizer.bos_token_id
    sep = tokenizer("\n\n", add_special_tokens=False).input_ids
    words = sorted({w for p in PASSAGES for w in p.split()})
    prompts: dict[str, list] = {kind: [] for kind in KINDS}
    for index, passage in enumerate(PASSAGES[:-1]):  # the last passage is the non-English alphabet sampler
        ids = tokenizer(passage, add_special_tokens=False).input_ids
        prompts["continue"].append(([bos, *ids[:CONTINUE_PREFIX]], ids[CONTINUE_PREFIX:]))
        quoted = ids[:QUOTE_LEN]
        prompts["quote"].append(([bos, *quoted, *sep, *quoted[:CUE_LEN]], quoted[CUE_LEN:]))
        rng = random.Random(index)
        shuffled = tokenizer(" ".join(rng.choice(words) for _ in range(QUOTE_LEN)), add_special_tokens=False)
        shuffled = shuffled.input_ids[:QUOTE_LEN]
        prompts["shuffled quote"].append(([bos, *shuffled, *sep, *shuffled[:CUE_LEN]], shuffled[CUE_LEN:]))
    return prompts


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens from a transformers model with its KV cache; EOS does not stop it."""
    # transformers 5 renamed past_key_values to cache (argument and output).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **{name: getattr(out, name)})
    return tokens


@torch.no_grad()
def agreement(draft, prompt: list[int], target_tokens: list[int]) -> int:
    """How many of target_tokens the draft's argmax predicts given the same prefix."""
    logits = draft(torch.tensor([prompt + target_tokens])).logits[0]
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    return sum(p == t for p, t in zip(predicted, target_tokens))


def corpus_ngrams(tokenizer, n: int = 4) -> set[tuple[int, ...]]:
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PASSAGES]
    return {tuple(t[i : i + n]) for t in ids for i in range(len(t) - n + 1)}


def evaluate(model, prompts, max_new_tokens: int, known: set[tuple[int, ...]]) -> tuple[dict, dict]:
    """kind -> {hit_rate, exact, corpus_4grams} (token-weighted over prompts), and kind -> outputs."""
    scores, outputs = {}, {}
    for kind, cases in prompts.items():
        outputs[kind] = [greedy(model, prompt, max_new_tokens) for prompt, _ in cases]
        n = sum(len(o) for o in outputs[kind])
        hits = sum(ngram_hit_rate(p, o) * len(o) for (p, _), o in zip(cases, outputs[kind]))
        exact = sum(sum(a == b for a, b in zip(o, ref)) for (_, ref), o in zip(cases, outputs[kind]))
        grams = [tuple(o[i : i + 4]) for o in outputs[kind] for i in range(len(o) - 3)]
        in_corpus = sum(g in known for g in grams) / max(1, len(grams))
        scores[kind] = {"hit_rate": hits / n, "exact": exact / n, "corpus_4grams": in_corpus}
    return scores, outputs


def make_trained(spec: ModelSpec, fresh: bool, scratch: Path) -> Path:
    if not fresh:
        return cached_checkpoint(spec).path
    out = scratch / spec.name
    write_checkpoint(spec, out)
    return out


def run(args) -> dict:
    import transformers

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    target_spec = ModelSpec(args.target_preset, "llama", seed=0, train_steps=args.target_steps)
    draft_spec = ModelSpec("draft", "llama", seed=0, train_steps=args.draft_steps)
    with tempfile.TemporaryDirectory(prefix="trained-model-bench-") as scratch:
        scratch = Path(scratch)
        models, training = {}, {}
        for role, spec in (("target", target_spec), ("draft", draft_spec)):
            trained_dir = make_trained(spec, args.fresh, scratch)
            random_dir = scratch / f"{spec.preset}-random"
            write_checkpoint(ModelSpec(spec.preset, spec.arch, spec.seed), random_dir)
            training[role] = json.loads((trained_dir / TRAINING_FILE).read_text())
            for state, path in (("random", random_dir), ("trained", trained_dir)):
                models[role, state] = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
            tokenizer = transformers.AutoTokenizer.from_pretrained(trained_dir)
        prompts = corpus_prompts(tokenizer)
        known = corpus_ngrams(tokenizer)
        scores, outputs = {}, {}
        for key, model in models.items():
            scores[key], outputs[key] = evaluate(model, prompts, args.max_new_tokens, known)
        agree = {}
        for state in ("random", "trained"):
            total = matched = 0
            for kind in KINDS:
                for (prompt, _), out in zip(prompts[kind], outputs["target", "trained"][kind]):
                    matched += agreement(models["draft", state], prompt, out)
                    total += len(out)
            agree[state] = matched / total
        samples = {
            state: [tokenizer.decode(o) for o in outputs["target", state]["continue"][:2]]
            + [tokenizer.decode(outputs["target", state]["quote"][0])]
            for state in ("random", "trained")
        }
    params = {role: sum(p.numel() for p in models[role, "trained"].parameters()) for role in ("target", "draft")}
    return {
        "argv": args.argv,
        "commit": source_commit(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "specs": {"target": target_spec.name, "draft": draft_spec.name},
        "presets": {"target": target_spec.preset, "draft": draft_spec.preset},
        "params": params,
        "training": training,
        "scores": {f"{role}/{state}": s for (role, state), s in scores.items()},
        "draft_agreement": agree,
        "samples": samples,
        "num_prompts": len(prompts["continue"]),
        "max_new_tokens": args.max_new_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    from splitserve.bench.models.trained_model_report import write_report

    parser = argparse.ArgumentParser(
        prog="python -m splitserve.bench.models.trained_model", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--target-preset", default="small", choices=["small", "bench"])
    parser.add_argument("--target-steps", type=int, default=300)
    parser.add_argument("--draft-steps", type=int, default=300)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--fresh", action="store_true", help="train into a temp dir instead of using the model cache")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report (a .png and .json beside it)")
    args = parser.parse_args(argv)
    if args.target_steps < 1 or args.draft_steps < 1 or args.max_new_tokens < 1:
        parser.error("--target-steps, --draft-steps and --max-new-tokens must be >= 1")
    args.argv = ["python", "-m", "splitserve.bench.models.trained_model", *(sys.argv[1:] if argv is None else argv)]
    result = run(args)
    write_report(result, args.out)
    print(f"wrote {args.out}; command: {shlex.join(args.argv)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
