"""The GPU path, checked in one run: `python bench/gpu_check/gpu_check.py OUT_DIR [--device cuda|cpu] [--tiny]`.

  1 parity      engine vs transformers on the device: llama, mistral, qwen2 test configs through
                the real loader; fp32 logits within 1e-4, bf16/fp16 greedy with a stated tolerance
  2 kernels     Triton paged decode attention and block gather/scatter, compiled, vs torch
  3 bandwidth   K/V bytes read per second by decode attention vs the device's copy bandwidth and
                SDPA on contiguous K/V (target >= 70% of copy at batch >= 32, context >= 4k);
                gather/scatter likewise
  4 throughput  LLMEngine decode on a ~1B random Llama in bf16, batch 1/32/256, each step split
                into GPU time and host overhead (the engine has no CUDA graphs)
  5 transfer    KV transfer between two processes on the one device: the same-device channel
                (CUDA IPC, host-memory fallback), in-place and packed (gather/scatter) layouts
  6 kv_quant    fp8 KV attention: the Triton kernel over an fp8 cache with per-(token, head)
                scales vs the bf16 kernel, correctness and speed at batch 1/32/64/256
  7 offload     the host KV tier: pinned host memory and side-stream copies bit-exact, their
                bandwidth, load vs recompute per block, multi-turn greedy identical with the tier
  8 quant       the quantized matmuls: fp8 (W8A8, torch._scaled_mm), int8 and int4 vs bf16 at
                batch 1/64/256, correctness and speed (bench/gpu_check/gpu_check_quant.py)
  9 overlap     async scheduling: decode step time with and without overlap at batch 1/8/64/256,
                forward vs host ms per step, the overlap achieved, greedy tokens identical
                (bench/gpu_check/gpu_check_overlap.py)
 10 tensor_parallel  a one-rank group, the sharded model, shard shapes
 11 tp_transfer KV transfer between prefill and decode TP sizes, rank by rank on the device: each
                decode rank gets exactly its KV heads (int8: and scales), the 1/1 bytes
                (bench/gpu_check/gpu_check_tp_transfer.py)
 12 architectures  the sliding-window decode kernel vs torch (freed blocks never read) and its
                time vs the full-context kernel; Mistral and Gemma 3 with small windows vs
                transformers on the device (bench/gpu_check/gpu_check_architectures.py)
 13 lora        the Triton LoRA shrink/expand (mixed adapters and base tokens) vs the torch path
                in fp32, bf16/fp16, decode and prefill steps, and their time vs the torch
                path's (bench/gpu_check/gpu_check_lora.py; on CPU check 2 cross-compiles them
                for sm_90)
 14 moe         the MoE experts: SparseMoeMlp, a padded bmm and torch._grouped_mm vs a float64
                reference on Mixtral- and Qwen3-MoE-like layers in bf16/fp16 at 1/32/256 tokens,
                and each one's time, to pick the CUDA path (bench/gpu_check/gpu_check_moe.py)

Each item is pass, fail, missed (a speed target not met) or info. OUT_DIR/gpu_check.md and
gpu_check.json are rewritten after every check, so a run cut short still leaves its report; the
exit status is 1 when an item failed. It needs torch, triton, transformers, safetensors and
tokenizers, no Ray, no network and no install: without an installed splitserve it maps the
repository's folders to splitserve.* itself. `--device cpu --tiny` runs the same checks at tiny
sizes with Triton interpreted (CI runs it: tests/bench/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECKS = {
    "parity": "1. Engine parity with transformers",
    "kernels": "2. Triton kernels (compiled) vs torch",
    "bandwidth": "3. Bandwidth",
    "throughput": "4. Engine decode throughput",
    "transfer": "5. KV transfer between two processes on one device",
    "kv_quant": "6. fp8 KV attention vs the bf16 kernel",
    "offload": "7. Host KV tier (kv_offloading_size)",
    "quant": "8. Quantized matmuls (fp8, int8) vs bf16",
    "overlap": "9. Async scheduling: step time with and without overlap",
    "tensor_parallel": "10. Tensor parallelism: a one-rank group, the sharded model, shard shapes",
    "tp_transfer": "11. KV transfer between prefill and decode TP sizes, rank by rank",
    "architectures": "12. Architectures: the sliding-window kernel, windowed models vs transformers",
    "lora": "13. Multi-LoRA: the Triton LoRA kernels vs the torch path",
    "moe": "14. MoE experts: the engine's per-expert matmuls, bmm and grouped matmul vs float64",
}
STATUSES = ("pass", "fail", "missed", "info")


def register_splitserve(repo: Path = REPO) -> str:
    """Make `splitserve.*` importable: the installed package if any, else this repository's
    folders, which setup.py installs as splitserve.<folder> (engine/ -> splitserve.engine)."""
    if "splitserve" in sys.modules or importlib.util.find_spec("splitserve") is not None:
        return "installed"
    spec = importlib.machinery.ModuleSpec("splitserve", None, is_package=True)
    spec.submodule_search_locations = [str(repo)]
    sys.modules["splitserve"] = importlib.util.module_from_spec(spec)
    return "repository"


# Run as a script, Python puts this folder first on sys.path; its modules are imported as
# splitserve.bench.gpu_check.* only (under their bare names they would load a second time).
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
# At import, not in main(): spawned children (check 5) re-import this file before they unpickle
# their target from splitserve.bench.gpu_check.gpu_check_transfer.
SPLITSERVE_SOURCE = register_splitserve()


def _environment(torch, device, args) -> dict:
    import transformers
    import triton

    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    env = {
        "command": " ".join(["python", "bench/gpu_check/gpu_check.py", *sys.argv[1:]]),
        # The caller's commit first: a device's copy of .git can be older than the tree sent.
        "commit": os.environ.get("GPU_CHECK_COMMIT") or commit or "unknown",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "splitserve from": SPLITSERVE_SOURCE,
        "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", ""),
        "sizes": "tiny" if args.tiny else "full",
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device=props.name,
            cuda=torch.version.cuda,
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
        )
    else:
        env["device"] = f"cpu ({os.cpu_count()} cores)"
    return env


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _markdown(report: dict) -> str:
    env, checks = report["environment"], report["checks"]
    counts = {s: sum(i["status"] == s for c in checks.values() for i in c["items"]) for s in STATUSES}
    lines = [
        f"# GPU check: {env.get('device', '?')}",
        "",
        f"`{env['command']}` at commit {env['commit']}, {env['date']}.",
        "",
        f"**{counts['pass']} passed, {counts['fail']} failed, {counts['missed']} speed targets missed**, "
        f"{counts['info']} measurements without a target.",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {key} | {value} |" for key, value in env.items() if key not in ("command", "commit", "date")]
    for name, check in checks.items():
        lines += ["", f"## {CHECKS[name]} ({check['seconds']:.1f} s)", ""]
        lines += ["| item | status | numbers | note |", "|---|---|---|---|"]
        for entry in check["items"]:
            numbers = ", ".join(f"{k}={_format(v)}" for k, v in entry["numbers"].items())
            note = entry["note"].replace("\n", "<br>").replace("|", "\\|")
            lines.append(f"| {entry['name']} | {entry['status']} | {numbers} | {note} |")
    return "\n".join(lines) + "\n"


def _write(out_dir: Path, report: dict) -> None:
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "gpu_check.md").write_text(_markdown(report))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python bench/gpu_check/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="where gpu_check.md and gpu_check.json go")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (required on cpu): a dry run of every check")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--budget-s", type=float, default=420.0, help="checks not started by then are reported failed")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only.split(",")) - set(CHECKS))
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
    if args.device == "cpu" and not args.tiny:
        parser.error("the full sizes need a GPU; on cpu add --tiny")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    # Triton reads this when the kernels are decorated, i.e. before they are imported.
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels are the point on a GPU
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run `--device cpu --tiny` for the dry run", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 matmuls
    torch.backends.cudnn.allow_tf32 = False
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes gain nothing from threads on a shared box

    from splitserve.bench.gpu_check import (
        gpu_check_architectures,
        gpu_check_engine,
        gpu_check_kv_quant,
        gpu_check_lora,
        gpu_check_moe,
        gpu_check_offload,
        gpu_check_ops,
        gpu_check_overlap,
        gpu_check_quant,
        gpu_check_tensor_parallel,
        gpu_check_throughput,
        gpu_check_tp_transfer,
        gpu_check_transfer,
    )

    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = {"environment": _environment(torch, device, args), "checks": {}}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        runs = {
            "parity": lambda: gpu_check_engine.check_parity(device, args.tiny, work),
            "kernels": lambda: gpu_check_ops.check_kernels(device, args.tiny),
            "bandwidth": lambda: gpu_check_ops.check_bandwidth(device, args.tiny),
            "throughput": lambda: gpu_check_throughput.check_throughput(device, args.tiny, work),
            "transfer": lambda: gpu_check_transfer.check_transfer(device, args.tiny),
            "kv_quant": lambda: gpu_check_kv_quant.check_fp8_kv(device, args.tiny),
            "offload": lambda: gpu_check_offload.check_offload(device, args.tiny, work),
            "quant": lambda: gpu_check_quant.check_quant(device, args.tiny),
            "overlap": lambda: gpu_check_overlap.check_overlap(device, args.tiny, work),
            "tensor_parallel": lambda: gpu_check_tensor_parallel.check_tensor_parallel(device, args.tiny, work),
            "tp_transfer": lambda: gpu_check_tp_transfer.check_tp_transfer(device, args.tiny),
            "architectures": lambda: gpu_check_architectures.check_architectures(device, args.tiny, work),
            "lora": lambda: gpu_check_lora.check_lora(device, args.tiny),
            "moe": lambda: gpu_check_moe.check_moe(device, args.tiny),
        }
        for name in [n for n in CHECKS if n in args.only.split(",")]:
            check_started = time.monotonic()
            if check_started - started > args.budget_s:
                result = {
                    "items": [gpu_check_ops.item("not run", "fail", f"the {args.budget_s:.0f} s budget was spent")]
                }
            else:
                try:
                    result = runs[name]()
                except Exception:
                    result = {"items": [gpu_check_ops.item("crashed", "fail", traceback.format_exc())]}
            result["seconds"] = time.monotonic() - check_started
            report["checks"][name] = result
            if device.type == "cuda":
                torch.cuda.empty_cache()
            _write(args.out_dir, report)
            counts = {s: sum(i["status"] == s for i in result["items"]) for s in STATUSES}
            print(f"gpu_check {name}: {counts} in {result['seconds']:.1f} s", flush=True)
    failed = [f"{n}: {i['name']}" for n, c in report["checks"].items() for i in c["items"] if i["status"] == "fail"]
    missed = [f"{n}: {i['name']}" for n, c in report["checks"].items() for i in c["items"] if i["status"] == "missed"]
    print(f"gpu_check: {len(failed)} failed {failed}, {len(missed)} targets missed {missed}; report in {args.out_dir}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
