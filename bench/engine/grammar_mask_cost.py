"""Per-token grammar mask cost of xgrammar and llguidance, side by side, on this machine.

Both libraries run the same five JSON schemas (splitserve.bench.serving.json_schemas) in one
process, interleaved per configuration, at batch 1 and batch 32, with two vocabularies: the
`bench` checkpoint's tokenizer and a 32 000-token byte-level BPE trained here on the Python
standard library's sources (a realistic vocabulary size; cached under ~/.cache/splitserve).
Each batch row walks its own instance: random logits (seeded) are masked by the row's matcher
and a token is sampled from them, exactly as the engine does, and the row restarts with the
next schema when its instance is complete. Timed per decode step:

  fill  = computing the batch's masks (xgrammar: BatchGrammarMatcher over its thread pool at
          batch > 1; llguidance: LLExecutor.fill_next_token_bitmask_par)
  apply = one bitmask op on the [batch, vocab] logits
  accept = advancing every row's matcher by its sampled token

and per-token cost = median over steps of (fill + apply + accept), / batch (medians: the
machine is shared, and other jobs' bursts land on single steps). It also counts instances that are not
valid JSON for their schema (json.loads + jsonschema), and times compiling each schema cold
and again once cached.

  python -m splitserve.bench.engine.grammar_mask_cost --model DIR_OF_BENCH_CHECKPOINT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from splitserve.bench import RESULTS_DIR, MissingBenchDependency, source_commit
from splitserve.bench.serving.json_schemas import SCHEMAS
from splitserve.engine.structured_output.token_bitmask import apply_token_bitmask_

DEFAULT_OUT = RESULTS_DIR / "grammar_mask_cost.md"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitserve"
LARGE_VOCAB = 32000
MAX_INSTANCE_STEPS = 400  # a runaway instance is cut here (counted as invalid)
MASK_THREADS = 2  # --mask-threads


def large_vocab_tokenizer_json(vocab_size: int = LARGE_VOCAB) -> str:
    """A byte-level BPE with vocab_size tokens, trained on the stdlib's sources (cached)."""
    path = CACHE_DIR / f"bench-stdlib-bpe-{vocab_size}.json"
    if path.is_file():
        return path.read_text()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, total = [], 0
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in file.parts:
            continue
        text = file.read_text(errors="ignore")
        texts.append(text)
        total += len(text)
        if total > 12_000_000:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    path.write_text(tokenizer.to_str())
    return path.read_text()


class XGrammarLib:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos_ids: list[int]):
        from tokenizers import Tokenizer

        try:
            import xgrammar as xgr
        except ModuleNotFoundError as exc:
            raise MissingBenchDependency(
                "this comparison needs xgrammar: pip install 'splitserve[grammar-bench]'", name="xgrammar"
            ) from exc
        self.xgr = xgr
        backend = Tokenizer.from_str(tokenizer_json)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        encoded = [""] * self.vocab_size
        for text, token_id in backend.get_vocab(with_added_tokens=True).items():
            encoded[token_id] = text
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        info = xgr.TokenizerInfo(
            encoded,
            meta["vocab_type"],
            vocab_size=self.vocab_size,
            stop_token_ids=eos_ids,
            add_prefix_space=meta["add_prefix_space"],
        )
        self.compiler = xgr.GrammarCompiler(info)
        self.batch = xgr.BatchGrammarMatcher(max_threads=MASK_THREADS)
        self.version = xgr.__version__ if hasattr(xgr, "__version__") else _dist_version("xgrammar")

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.accept_token(token)

    @staticmethod
    def done(matcher) -> bool:
        return matcher.is_terminated()


class LLGuidanceLib:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos_ids: list[int]):
        import llguidance
        import llguidance.torch as llg_torch

        self.llg, self.llg_torch = llguidance, llg_torch
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_ids)
        self.vocab_size = self.tokenizer.vocab_size
        self.executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        self.version = _dist_version("llguidance")

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            self.llg_torch.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.llg_torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    @staticmethod
    def accept(matcher, token: int) -> bool:
        return matcher.consume_token(token)

    @staticmethod
    def done(matcher) -> bool:
        return matcher.is_stopped()


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def time_compile(lib, schemas: dict[str, dict]) -> dict[str, float]:
    """Mean seconds per schema: cold (first compile), cached (compile again + a matcher)."""
    cold, cached = [], []
    for schema in schemas.values():
        start = time.perf_counter()
        compiled = lib.compile(schema)
        lib.matcher(compiled)
        cold.append(time.perf_counter() - start)
    if lib.name == "llguidance":  # no compiled-grammar cache of its own: a copied template
        templates = {name: lib.compile(s) for name, s in schemas.items()}
        for name in schemas:
            start = time.perf_counter()
            lib.matcher(templates[name])
            cached.append(time.perf_counter() - start)
    else:
        for schema in schemas.values():
            start = time.perf_counter()
            lib.matcher(lib.compile(schema))
            cached.append(time.perf_counter() - start)
    return {"cold_s": statistics.mean(cold), "cached_s": statistics.mean(cached)}


def run_batch(lib, compiled: list, batch: int, steps: int, seed: int) -> dict:
    """Decode `steps` steps of `batch` rows under the grammar; per-phase times and validity."""
    gen = torch.Generator().manual_seed(seed)
    vocab = lib.vocab_size
    bitmask = torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int32)
    which = list(range(batch))
    matchers = [lib.matcher(compiled[i % len(compiled)]) for i in which]
    outputs: list[list[int]] = [[] for _ in which]
    fill, apply, accept = [], [], []
    cpu_s = 0.0
    instances: list[tuple[int, list[int]]] = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen) * 3
        c0, t0 = time.process_time(), time.perf_counter()
        lib.fill(matchers, bitmask)
        t1 = time.perf_counter()
        apply_token_bitmask_(logits, bitmask)  # the engine's op, the same for both libraries
        t2, c2 = time.perf_counter(), time.process_time()
        tokens = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen).squeeze(1).tolist()
        c3, t3 = time.process_time(), time.perf_counter()
        for row, token in enumerate(tokens):
            if not lib.accept(matchers[row], token):
                raise RuntimeError(f"{lib.name} rejected a token its own mask allowed")
        t4, c4 = time.perf_counter(), time.process_time()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        accept.append(t4 - t3)
        cpu_s += (c2 - c0) + (c4 - c3)
        for row, token in enumerate(tokens):
            outputs[row].append(token)
            if lib.done(matchers[row]) or len(outputs[row]) >= MAX_INSTANCE_STEPS:
                instances.append((which[row] % len(compiled), outputs[row]))
                which[row] += batch
                matchers[row] = lib.matcher(compiled[which[row] % len(compiled)])
                outputs[row] = []
    num_tokens = steps * batch
    # Medians per step: robust to the other jobs' bursts on this shared machine.
    per_token = 1e6 / batch
    total = [f + a + c for f, a, c in zip(fill, apply, accept)]
    return {
        "fill_us_per_token": per_token * statistics.median(fill),
        "apply_us_per_token": per_token * statistics.median(apply),
        "accept_us_per_token": per_token * statistics.median(accept),
        "total_us_per_token": per_token * statistics.median(total),
        "ms_per_step": 1e3 * statistics.median(total),
        "cpu_us_per_token": 1e6 * cpu_s / num_tokens,
        "instances": instances,
    }


def count_invalid(instances: list, schemas: list[dict], tokenizer_json: str, eos_ids: list[int]) -> tuple[int, int]:
    import jsonschema
    from tokenizers import Tokenizer

    decode = Tokenizer.from_str(tokenizer_json).decode
    bad = 0
    for schema_index, tokens in instances:
        text = decode([t for t in tokens if t not in eos_ids])
        try:
            jsonschema.validate(json.loads(text), schemas[schema_index])
        except (ValueError, jsonschema.ValidationError):
            bad += 1
    return bad, len(instances)


def measure(tokenizer_json: str, eos_ids: list[int], batches: list[int], steps: int, seed: int) -> dict:
    libs = [XGrammarLib(tokenizer_json, eos_ids), LLGuidanceLib(tokenizer_json, eos_ids)]
    schemas = list(SCHEMAS.values())
    out = {"vocab_size": libs[0].vocab_size, "libs": {}}
    for lib in libs:
        out["libs"][lib.name] = {"version": lib.version, "compile": time_compile(lib, SCHEMAS), "batches": {}}
    for batch in batches:
        for lib in libs:  # interleaved: both see the same machine load
            compiled = [lib.compile(s) for s in schemas]
            run_batch(lib, compiled, batch, max(steps // 5, 10), seed + 1)  # warm-up: lazy caches, kernels
            result = run_batch(lib, compiled, batch, steps if batch > 1 else steps * 4, seed)
            bad, total = count_invalid(result.pop("instances"), schemas, tokenizer_json, eos_ids)
            result["invalid_instances"], result["num_instances"] = bad, total
            out["libs"][lib.name]["batches"][batch] = result
            print(
                f"vocab {out['vocab_size']:>6} {lib.name:>10} batch {batch:>3}: "
                f"{result['total_us_per_token']:8.1f} us/token (fill {result['fill_us_per_token']:.1f}, "
                f"apply {result['apply_us_per_token']:.1f}, accept {result['accept_us_per_token']:.1f}), "
                f"{result['ms_per_step']:.2f} ms/step, cpu {result['cpu_us_per_token']:.1f} us/token, invalid {bad}/{total}",
                flush=True,
            )
    return out


def render(results: dict[str, dict], command: str, commit: str, num_threads: int) -> str:
    lines = [
        "# Grammar mask cost: xgrammar vs llguidance",
        "",
        f"Command: `{command}`  ",
        f"{commit}; torch threads {num_threads}, mask-fill threads {MASK_THREADS}; {os.cpu_count()} CPUs "
        f"(shared with other jobs; load average {os.getloadavg()[0]:.1f} at the end).",
        "",
        "Per-token cost = median per step of (fill masks + apply one bitmask op to the logits + accept",
        "the sampled tokens) / batch; CPU us/token = process CPU time (all threads) / tokens, the mean.",
        "Seeded random logits, five JSON schemas (bench/serving/json_schemas.py),",
        "compact JSON (no free whitespace). `invalid` counts finished instances that json.loads +",
        "jsonschema reject. Compile: cold = first compile + matcher, cached = what a repeated schema",
        "costs (xgrammar: compiler cache hit + matcher; llguidance: deep copy of a cached matcher).",
        "",
        "| vocabulary | library | batch | us/token | fill | apply | accept | ms/step | CPU us/token | invalid JSON |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for vocab_name, res in results.items():
        for lib_name, lib in res["libs"].items():
            for batch, r in lib["batches"].items():
                lines.append(
                    f"| {vocab_name} ({res['vocab_size']}) | {lib_name} {lib['version']} | {batch} | "
                    f"{r['total_us_per_token']:.1f} | {r['fill_us_per_token']:.1f} | {r['apply_us_per_token']:.1f} | "
                    f"{r['accept_us_per_token']:.1f} | {r['ms_per_step']:.2f} | {r['cpu_us_per_token']:.1f} | "
                    f"{r['invalid_instances']}/{r['num_instances']} |"
                )
    lines += ["", "| vocabulary | library | compile cold (ms) | compile cached (ms) |", "|---|---|---:|---:|"]
    for vocab_name, res in results.items():
        for lib_name, lib in res["libs"].items():
            c = lib["compile"]
            lines.append(f"| {vocab_name} | {lib_name} | {1e3 * c['cold_s']:.2f} | {1e3 * c['cached_s']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint dir whose tokenizer.json is one vocabulary")
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--steps", type=int, default=150, help="decode steps per batch>1 run (batch 1: 4x)")
    # One torch thread: on a loaded 2-core box OpenMP's spinning barriers make a tiny op take ms.
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's tests and workers use 1)")
    parser.add_argument("--mask-threads", type=int, default=2, help="threads of the libraries' batch mask fill")
    parser.add_argument("--no-large-vocab", action="store_true", help=f"skip the {LARGE_VOCAB}-token vocabulary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    global MASK_THREADS
    MASK_THREADS = args.mask_threads
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model_json = (Path(args.model) / "tokenizer.json").read_text()
    eos = json.loads((Path(args.model) / "generation_config.json").read_text()).get("eos_token_id", [])
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    results = {"bench model": measure(model_json, eos_ids, batches, args.steps, args.seed)}
    if not args.no_large_vocab:
        large = large_vocab_tokenizer_json()
        results["stdlib BPE"] = measure(large, [1], batches, args.steps, args.seed)
    command = "python -m splitserve.bench.engine.grammar_mask_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(results, command, source_commit(), torch.get_num_threads())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
