"""The vLLM side of bench/engine/engine_throughput.py, run by the vLLM venv's python as a script.

It imports only the standard library and vllm (splitserve is not installed in that venv).
It builds one vllm.LLM, then serves jobs from stdin, one JSON object per line:
  {"prompts": [[token ids], ...], "max_tokens": N}
and answers each with one stdout line `RESULT_MARKER + json` holding the wall time of
LLM.generate, the CPU time all of vLLM's processes spent meanwhile, and the generated token ids. vLLM's own logging may share stdout, hence the marker.
An empty line or EOF ends it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

RESULT_MARKER = "@@engine_throughput@@ "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="skip torch.compile (vLLM's default on CPU is to compile)"
    )
    return parser.parse_args(argv)


def cpu_seconds() -> float | None:
    """User+system CPU seconds of this process and all its live children (vLLM's engine core
    and workers are child processes), or None without psutil (a vLLM dependency)."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue  # exited meanwhile
        total += times.user + times.system
    return total


def reply(payload: dict) -> None:
    sys.stdout.write(RESULT_MARKER + json.dumps(payload) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        dtype="float32",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
    )
    reply({"ready": True, "vllm_version": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=True)
        prompts = [{"prompt_token_ids": list(ids)} for ids in job["prompts"]]
        cpu_start = cpu_seconds()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        cpu_end = cpu_seconds()
        reply(
            {
                "seconds": seconds,
                "cpu_seconds": None if cpu_start is None else cpu_end - cpu_start,
                "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
            }
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
