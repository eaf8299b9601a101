"""Runs the speculative-decoding benchmark of ../spec_decode.md: for each configuration, start
`splitserve serve` (colocated: 0 prefill + 1 decode replica, 1 torch thread) on a free port,
run `splitserve bench --url` against it, snapshot its /metrics (the splitserve_spec_decode_*
series: acceptance and the chosen-k counts), stop it. Configurations run back to back, in the
order given; every one gets the same requests (same --seed).

  .venv/bin/python bench/results/spec_decode/run.py quote_c1 | mixed_c32 | mixed_c32_rev | quote_c1_vllm
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from splitserve.bench.managed_server import ManagedServer

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
M = "/root/.cache/splitserve/models/720e346365b9eb53/bench-llama-trained1000"
D = "/root/.cache/splitserve/models/c5627c59af78d28e/draft-llama-trained1000"
SERVE = f"{BIN}/splitserve serve {M} --prefill-replicas 0 --decode-replicas 1 --decode-num-cpus 1 --http-port {{port}} --grpc-port 0"
VLLM = (
    f"VLLM_CPU_KVCACHE_SPACE=1 PYTHONPATH={HERE.parent}/splitserve_vs_vllm/vllm_shim"
    f" /work/venvs/vllm/bin/python -m vllm.entrypoints.openai.api_server --model {M}"
    " --host 127.0.0.1 --port {port} --dtype float32 --max-model-len 4096"
)
VLLM_NGRAM = (
    """ --speculative-config '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,"""
    """ "prompt_lookup_max": 4}'"""
)
QUOTE = ["--workload", "quote", "--tokenizer", M, "--num-requests", "8", "--max-tokens", "128", "--concurrency", "1"]
RUNS = {
    "quote_c1": (
        QUOTE,
        {
            "none": SERVE,
            "ngram": SERVE + " --speculative.method ngram",
            "ngram-fixed4": SERVE
            + " --speculative.method ngram --speculative.policy fixed --speculative.num-speculative-tokens 4",
            "draft": SERVE + f" --speculative.method draft --speculative.draft-model {D}",
            # The mechanism at its best: every draft token accepted (the policy would turn it off:
            # a draft as costly as the target cannot pay, so it is fixed here).
            "draft=target": SERVE
            + f" --speculative.method draft --speculative.draft-model {M} --speculative.policy fixed",
        },
    ),
    "mixed_c32": (
        [
            "--workload",
            "mixed",
            "--num-requests",
            "96",
            "--short-len",
            "128",
            "--long-fraction",
            "0",
            "--length-jitter",
            "0",
            "--max-tokens",
            "64",
            "--vocab-range",
            "10:2000",
            "--concurrency",
            "32",
        ],
        {"none": SERVE, "ngram": SERVE + " --speculative.method ngram"},
    ),
    "quote_c1_vllm": (QUOTE, {"vllm-none": VLLM, "vllm-ngram": VLLM + VLLM_NGRAM}),
}
RUNS["mixed_c32_rev"] = (RUNS["mixed_c32"][0], dict(reversed(list(RUNS["mixed_c32"][1].items()))))  # the other order


def spec_series(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("splitserve_spec_decode"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                out[f"{s.name}{{{labels}}}"] = s.value
    return out


def main(name: str) -> None:
    args, configs = RUNS[name]
    out_dir = HERE / name
    out_dir.mkdir(parents=True, exist_ok=True)
    for config, command in configs.items():
        tag = config.replace("=", "-eq-")
        with ManagedServer(command, log_path=out_dir / f"{tag}.server.log") as server:
            bench = [
                f"{BIN}/splitserve",
                "bench",
                "--url",
                server.base_url,
                *args,
                "--ignore-eos",
                "--seed",
                "0",
                "--no-progress",
                "--out",
                str(out_dir / tag),
            ]
            print("$", " ".join(bench), flush=True)
            subprocess.run(bench, check=True, timeout=900)
            metrics = spec_series(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
        (out_dir / f"{tag}.spec_metrics.json").write_text(json.dumps(metrics, indent=1, sort_keys=True))
        print(config, json.dumps(metrics), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
