"""bench/gpu_check/gpu_check.py: the CPU dry run of the GPU checks (tiny sizes, Triton interpreted) passes,
so the script a lent GPU runs cannot rot; and it runs as it must there: without an installed
splitserve, importing only what the device's image has and the wheels carried to it
(bench/gpu_check/device_wheels.py; tests/helpers/device_python makes this python look so)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitserve.bench.gpu_check.device_wheels import CARRIED_MODULES, DEVICE_IMAGE_MODULES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check" / "gpu_check.py"
CHECKS = [
    "parity",
    "kernels",
    "bandwidth",
    "throughput",
    "transfer",
    "kv_quant",
    "offload",
    "quant",
    "overlap",
    "tensor_parallel",
    "tp_transfer",
    "architectures",
    "lora",
    "moe",
]


# The whole dry run in one subprocess: 34 s on a quiet CI machine, many times that on a busy one.
# Only a hang is bounded (the suite's 300 s per-test default would bound the work).
HANG_SAFETY_NET_S = 1800


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT / "tests" / "helpers" / "device_python"),
        SPLITSERVE_DEVICE_ROOT=str(ROOT),
        SPLITSERVE_DEVICE_MODULES=",".join(DEVICE_IMAGE_MODULES + CARRIED_MODULES),
    )
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--device", "cpu", "--tiny"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_SAFETY_NET_S,
    )
    return completed, out


@pytest.mark.timeout(HANG_SAFETY_NET_S)
def test_cpu_dry_run_passes_every_check(dry_run):
    completed, out = dry_run
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert list(report["checks"]) == CHECKS
    for name, check in report["checks"].items():
        assert check["items"], name
        statuses = {entry["status"] for entry in check["items"]}
        assert statuses <= {"pass", "info"}, (name, check["items"])  # no failure, no target applies on CPU
    assert report["environment"]["TRITON_INTERPRET"] == "1"
    items = {(name, entry["name"]): entry for name, check in report["checks"].items() for entry in check["items"]}
    # Every architecture in every dtype, through the real loader and LLMEngine.
    for arch in ("llama", "mistral", "qwen2"):
        assert items[("parity", f"{arch} fp32 logits")]["numbers"]["decode_max_abs"] <= 1e-4
        for dtype in ("bfloat16", "float16"):
            assert items[("parity", f"{arch} {dtype} greedy prompt 1")]["status"] == "pass"
    assert "interpreted" in items[("kernels", "triton mode")]["note"]
    for kv in ("fp8", "int8"):  # the quantized-KV kernel variants cross-compile for Hopper
        assert items[("kernels", f"decode attention {kv} KV bf16 compiles for sm_90")]["status"] == "pass"
    for kernel in ("shrink", "expand"):  # the LoRA kernels too (bench/gpu_check/gpu_check_lora.py)
        for dtype in ("bf16", "fp16"):
            assert items[("kernels", f"lora {kernel} {dtype} compiles for sm_90")]["status"] == "pass"
    # The same-device transport: each mode got its channel and moved both layouts bit-exactly.
    for mode, channel in (("auto", "gloo"), ("ipc", "ipc"), ("host", "host")):
        assert items[("transfer", f"{mode} channel")]["status"] == "pass"
        for layout in ("in-place", "packed"):
            assert items[("transfer", f"{channel} {layout}")]["status"] == "pass"
    assert items[("throughput", "decode batch 8")]["numbers"]["tokens_per_s"] > 0
    for batch, context in ((1, 40), (3, 33)):  # the fp8 KV kernel against the 16-bit one
        fp8 = items[("kv_quant", f"fp8 KV attention b={batch} ctx={context}")]
        assert fp8["status"] == "pass" and fp8["numbers"]["max_abs_error_vs_bf16_kernel"] > 0
    # Tensor parallelism: the sharded model on a one-rank group is the whole model; shards tile it.
    assert items[("tensor_parallel", "sharded model on a 1-rank group")]["numbers"]["logits_max_abs"] <= 1e-5
    for size in (2, 4):
        assert items[("tensor_parallel", f"TP {size} shards tile the model")]["status"] == "pass"
    # KV transfer between TP sizes: each decode rank's heads exact, the 1/1 bytes.
    for name in ("P/D 2/1, 4 KV heads, auto KV", "P/D 1/2, 4 KV heads, auto KV", "P/D 4/2, 4 KV heads, int8 KV"):
        assert items[("tp_transfer", name)]["status"] == "pass"
    # The host KV tier: copies bit-exact, hits loaded, greedy tokens unchanged.
    assert items[("offload", "save/load round trip")]["status"] == "pass"
    assert items[("offload", "multi-turn greedy with the tier")]["numbers"]["loaded_blocks"] > 0
    # The quantized matmuls: each scheme at each batch within its tolerance of bf16 (CPU: fp8 emulated).
    for scheme in ("fp8", "int8", "int4"):
        for batch in (1, 64, 256):
            assert items[("quant", f"{scheme} batch {batch}")]["status"] == "pass"
    assert "emulated" in items[("quant", "fp8 path")]["note"]
    # Async scheduling: both modes decode the same greedy tokens; the timing split is reported.
    for batch in (1, 8):
        overlap = items[("overlap", f"decode batch {batch}")]
        assert overlap["status"] == "info", overlap
        numbers = overlap["numbers"]
        assert numbers["overlap_ms_per_step"] > 0 and numbers["sync_ms_per_step"] > 0
        assert numbers["overlap_forward_ms"] > 0 and numbers["sync_host_ms"] > 0
    # The Triton LoRA kernels (interpreted here) against the fp32 torch path, mixed steps, both 16-bit dtypes.
    for dtype in ("float16", "bfloat16"):
        for step in ("decode 5", "prefill 3x6"):
            lora = items[("lora", f"{step} {dtype}")]
            assert lora["status"] == "pass" and 0 < lora["numbers"]["err_kernel"], lora
    # The MoE experts: the engine's path and the padded bmm against float64, both timed.
    for shape in ("mixtral-like", "qwen3-moe-like"):
        for dtype in ("float16", "bfloat16"):
            for tokens in (1, 5, 17):
                moe = items[("moe", f"{shape} {dtype} tokens {tokens}")]
                numbers = moe["numbers"]
                assert moe["status"] == "pass" and 0 < numbers["err_engine"] and numbers["bmm_ms"] > 0, moe


@pytest.mark.timeout(HANG_SAFETY_NET_S)
def test_report_is_markdown_with_every_check(dry_run):
    _, out = dry_run
    text = (out / "gpu_check.md").read_text()
    assert text.startswith("# GPU check: cpu")
    for title in (
        "Engine parity",
        "Triton kernels",
        "Bandwidth",
        "decode throughput",
        "KV transfer",
        "fp8 KV attention",
        "Host KV tier",
        "Quantized matmuls",
        "Async scheduling",
        "Multi-LoRA",
        "MoE experts",
    ):
        assert f"{title}" in text
    assert "| llama fp32 logits | pass |" in text


def test_bad_arguments_are_refused_before_any_work(tmp_path):
    for args, message in (
        (["--device", "cpu"], "on cpu add --tiny"),
        (["--device", "cpu", "--tiny", "--only", "parity,speed"], "unknown check(s) speed"),
    ):
        completed = subprocess.run(
            [sys.executable, str(SCRIPT), str(tmp_path), *args], capture_output=True, text=True, timeout=60
        )
        assert completed.returncode == 2 and message in completed.stderr
    assert not list(tmp_path.iterdir())


def test_imports_splitserve_from_the_repository_without_an_install(tmp_path):
    """-S drops site-packages (and the editable install): the script maps the folders itself."""
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import gpu_check; "
        "import splitserve.engine.config as c, splitserve.kvtransfer.kv_channel as k, splitserve.bench.gpu_check.gpu_check as g; "
        "print(gpu_check.SPLITSERVE_SOURCE, c.__file__, k.__file__, g.__file__)"
    )
    completed = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    source, *files = completed.stdout.split()
    assert source == "repository"
    assert files == [str(ROOT / "engine" / "config.py"), str(ROOT / "kvtransfer" / "kv_channel.py"), str(SCRIPT)]
