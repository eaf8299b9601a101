"""splitserve.engine.ops.triton_decode_attention and triton_kernels (run by the Triton interpreter on CPU) and splitserve.engine.ops.block_copy (torch path).

The kernel checks live in tests/helpers/triton_cases.py and run once, in a subprocess with
TRITON_INTERPRET=1 (triton.jit reads it at decoration time, and this pytest process may already
have imported the kernels without it); each case is then reported as its own test here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.engine.ops import block_copy

ROOT = Path(__file__).resolve().parents[2]
CASES_PATH = ROOT / "tests" / "helpers" / "triton_cases.py"


def _load_cases_module():
    # By path: works whether or not tests/ is a package (it imports no triton at module level).
    spec = importlib.util.spec_from_file_location("_triton_kernel_cases", CASES_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cases = _load_cases_module()
# One worker runs this file: the interpreted cases' one subprocess (interpreted_results) then runs once.
pytestmark = pytest.mark.one_worker
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


# Every interpreted case in one subprocess: 13 s on a quiet CI machine, many times that on a busy
# one. Only a hang is bounded (the suite's 300 s per-test default would bound the work).
HANG_SAFETY_NET_S = 1800


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    completed = subprocess.run(
        [sys.executable, str(CASES_PATH)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_SAFETY_NET_S,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.timeout(HANG_SAFETY_NET_S)
@pytest.mark.parametrize("case", sorted(cases.CASES))
def test_kernel_case_under_interpreter(interpreted_results, case):
    assert interpreted_results.get(case) == "ok", interpreted_results.get(case, "case did not run")


@needs_triton
def test_attention_rejects_bad_inputs():
    from splitserve.engine.ops.triton_decode_attention import KernelInputError, paged_decode_attention

    q = torch.zeros(2, 3, 8)
    cache = torch.zeros(4, 4, 2, 8)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="multiple of kv heads"):
        paged_decode_attention(q, cache, cache, tables, lens, 1.0)
    q = torch.zeros(2, 4, 8)
    with pytest.raises(KernelInputError, match="block_tables must be int32"):
        paged_decode_attention(q, cache, cache, tables.long(), lens, 1.0)
    with pytest.raises(KernelInputError, match="dtypes differ"):
        paged_decode_attention(q, cache.half(), cache.half(), tables, lens, 1.0)
    with pytest.raises(KernelInputError, match="head_dim mismatch"):
        paged_decode_attention(torch.zeros(2, 4, 16), cache, cache, tables, lens, 1.0)

    with pytest.raises(KernelInputError, match="num_splits must be >= 1"):
        paged_decode_attention(q, cache, cache, tables, lens, 1.0, num_splits=0)


@needs_triton
def test_split_choice_fills_the_sms_only_where_the_batch_cannot():
    from splitserve.engine.ops.triton_decode_attention import choose_num_splits

    # 32 sequences x 8 KV heads = 256 programs for 132 SMs: split to ~8 programs per SM.
    assert choose_num_splits(32, 8, 4096, 132) == 5
    assert choose_num_splits(1, 8, 32768, 132) == 64  # capped
    # Enough programs already, or too short a context to split (>= 256 tokens a split): one pass.
    assert choose_num_splits(256, 8, 8192, 132) == 1
    assert choose_num_splits(4, 8, 300, 132) == 1
    assert choose_num_splits(4, 8, 1024, 132) == 4  # limited by the context, not the SMs


@needs_triton
def test_kernel_copy_rejects_mismatched_buffer():
    from splitserve.engine.ops.triton_input_checks import KernelInputError
    from splitserve.engine.ops.triton_kernels import gather_blocks

    with pytest.raises(KernelInputError, match="does not match"):
        gather_blocks(torch.zeros(2, 5, 6), torch.tensor([1, 2]), torch.empty(2, 3, 6))


def test_block_copy_cpu_round_trip_of_cache_layer():
    kv = torch.randn(3, 2, 8, 4, 2, 5)  # [layer, K|V, block, offset, kv_head, head_dim]
    planes = kv[1].view(2, 8, -1)
    packed = block_copy.gather_blocks(planes, [6, 1, 3])
    assert packed.is_contiguous() and packed.shape == (2, 3, 40)
    assert torch.equal(packed.view(2, 3, 4, 2, 5), kv[1][:, [6, 1, 3]])
    restored = torch.zeros_like(kv)
    block_copy.scatter_blocks(packed, restored[1].view(2, 8, -1), torch.tensor([6, 1, 3], dtype=torch.int32))
    assert torch.equal(restored[1][:, [6, 1, 3]], kv[1][:, [6, 1, 3]])
    assert torch.count_nonzero(restored[1][:, [0, 2, 4, 5, 7]]) == 0
    assert torch.count_nonzero(restored[0]) == 0 and torch.count_nonzero(restored[2]) == 0


def test_block_copy_all_layers_into_given_buffer():
    kv = torch.randn(2, 2, 5, 2, 1, 3)
    out = torch.empty(4, 2, 6)
    returned = block_copy.gather_blocks(kv.view(4, 5, -1), torch.tensor([4, 0]), out=out)
    assert returned is out
    assert torch.equal(out.view(2, 2, 2, 2, 1, 3), kv[:, :, [4, 0]])


def test_block_copy_rejects_bad_arguments():
    planes = torch.zeros(2, 5, 6)
    with pytest.raises(block_copy.BlockCopyError, match="expected"):
        block_copy.gather_blocks(planes, [1, 2], out=torch.empty(2, 3, 6))
    with pytest.raises(block_copy.BlockCopyError, match="1-D"):
        block_copy.gather_blocks(planes, torch.tensor([[1, 2]]))
    with pytest.raises(block_copy.BlockCopyError, match="contiguous"):
        block_copy.gather_blocks(planes, [1, 2], out=torch.empty(2, 6, 2).transpose(1, 2))
    with pytest.raises(block_copy.BlockCopyError):
        block_copy.scatter_blocks(torch.zeros(2, 2, 6, dtype=torch.float16), planes, [0, 1])


def test_block_copy_reports_triton_availability():
    assert block_copy.HAS_TRITON == (importlib.util.find_spec("triton") is not None)


@needs_triton
def test_lora_kernels_reject_bad_inputs():
    from splitserve.engine.ops.triton_lora import KernelInputError, lora_expand, lora_shrink

    x, a_t, slots = torch.zeros(3, 8), torch.zeros(2, 8, 4), torch.zeros(3, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="token_slots must be int32/int64"):
        lora_shrink(x, a_t, slots.float())
    with pytest.raises(KernelInputError, match=r"a_t must be \[slots, 8, cols\]"):
        lora_shrink(x, torch.zeros(2, 6, 4), slots)
    with pytest.raises(KernelInputError, match="contiguous in features"):
        lora_shrink(torch.zeros(8, 3).T, a_t, slots)
    shrunk, b, out = torch.zeros(3, 4), torch.zeros(2, 4, 5), torch.zeros(3, 5)
    with pytest.raises(KernelInputError, match="one per slot"):
        lora_expand(shrunk, b, slots, torch.ones(3), out)
    with pytest.raises(KernelInputError, match=r"out must be \[3, 5\]"):
        lora_expand(shrunk, b, slots, torch.ones(2), torch.zeros(3, 6))
