"""Quantized weights under tensor parallelism (engine/parallel/quantized_shards.py): each rank
holds exactly its slice of TP 1's quantized values and scales (int8 per-channel scales over the
whole row even for a row-parallel weight, int4 groups cut whole, compressed-tensors tensors cut
after assembly), and TP-2 greedy generation gives TP 1's tokens on the trained small model. Two
gloo ranks; a quantization group a rank would split is a one-line start-up error naming the
numbers (engine and CLI here; the serve preflight in tests/cluster/test_tensor_parallel_config.py).

Tolerance: the CPU int8/int4 kernels take bf16 activations and return bf16, so each rank's
partial o/down output is rounded to bf16 before the all-reduce adds them, where TP 1 rounds the
sum once: log-probabilities move by up to ~0.03. Greedy tokens must agree wherever TP 1's best
token leads the next one by more than TIE_MARGIN; a closer race may go either way. TP 2's free
generation must equal TP 1's up to the first such race; past it, TP 2 scores TP 1's sequences
(teacher forcing) and must pick TP 1's token at every position that is no race, with every
log-probability within LOGPROB_TOL."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model.loader import load_model
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.parallel.shard_plan import ShardPlan
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cli import run_cli
from tests.helpers.compressed_checkpoint import write_compressed_checkpoint, write_hf_fp8_checkpoint
from tests.helpers.model import READS_TRAINED_CHECKPOINT, make_checkpoint

LOGPROB_TOL = 0.06  # bf16 rounding of each rank's partial sums (measured up to ~0.03)
TIE_MARGIN = 2 * LOGPROB_TOL
PROMPTS = ["Hello, how are you today?", "The river runs", "Once upon a time there was"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def trained_small() -> str:
    # Trained (about 100 s of CPU where the shared cache lacks it): its greedy continuations are
    # text, not the near-ties of random weights.
    return str(cached_checkpoint(ModelSpec("small", "llama", seed=0, train_steps=300)).path)


def _run(model: str, tp: int, quantization: str, forced: list[list[int]] | None = None):
    """TP `tp`'s greedy outputs for PROMPTS; then, with forced (TP 1's prompts + tokens), its
    prompt log-probabilities over those sequences (teacher forcing: every position compared
    on the same prefix, past any race the free-running outputs took differently)."""
    engine = LLMEngine(EngineConfig(model=model, num_kv_blocks=64, quantization=quantization, tensor_parallel_size=tp))
    try:
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
        free = engine.generate(prompts, params)
        if forced is None:
            return prompts, free, None
        scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
        return prompts, free, engine.generate(forced, scoring)
    finally:
        engine.close()


def _assert_greedy_parity(model: str, quantization: str = "none") -> None:
    prompts, tp1, _ = _run(model, 1, quantization)
    forced = [p + out.token_ids for p, out in zip(prompts, tp1)]
    _, tp2, scored = _run(model, 2, quantization, forced)
    compared = 0
    for prompt, one, two, score in zip(prompts, tp1, tp2, scored):
        free_running = True
        for step, (token, top) in enumerate(zip(one.token_ids, one.top_logprobs)):
            (_, best), (_, second) = top[:2]
            race = best - second < TIE_MARGIN  # either token is right
            free_running = free_running and not race
            if free_running:  # TP 2 generated the same tokens so far
                assert two.token_ids[step] == token, (one.text, two.text)
            at = len(prompt) - 1 + step  # prompt_logprobs[i]: forced token i + 1 given the ones before
            assert abs(score.prompt_logprobs[at] - one.logprobs[step]) <= LOGPROB_TOL
            if not race:
                assert score.prompt_top_logprobs[at][0][0] == token
                compared += 1
    assert compared >= len(PROMPTS) * MAX_TOKENS * 3 // 4, f"only {compared} tokens compared"


@pytest.mark.slow  # the trained model, where the shared cache lacks it
@READS_TRAINED_CHECKPOINT
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_tp2_quantized_greedy_equals_tp1(trained_small, quantization):
    _assert_greedy_parity(trained_small, quantization)


@pytest.mark.slow
@READS_TRAINED_CHECKPOINT
def test_tp2_compressed_tensors_checkpoint_equals_tp1(trained_small, tmp_path):
    """A W4A16 (pack-quantized int4, groups of 128) checkpoint written by compressed-tensors:
    each rank cuts the assembled values, scales and zero points."""
    from pathlib import Path

    checkpoint = str(write_compressed_checkpoint(Path(trained_small), tmp_path / "w4a16", "W4A16_ASYM"))
    _assert_greedy_parity(checkpoint)


def _shard(model: str, rank: int, quantization: str):
    """Rank `rank` of 2's shard, loaded in this process (the group's collectives unused by a load)."""
    plan = ShardPlan(ModelConfig.from_pretrained(model), 2, rank)
    group = SimpleNamespace(plan=plan, size=2, rank=rank, all_reduce=None)
    shard, _ = load_model(model, quantization=quantization, tensor_parallel=group)
    return shard


@pytest.mark.parametrize(("quantization", "arch"), [("int8", "llama"), ("fp8", "llama"), ("int8", "phi3")])
def test_each_rank_holds_its_slice_of_tp1s_quantized_values(models_root, quantization, arch):
    """Column-parallel rows and row-parallel columns of TP 1's quantized weights, value for value,
    with TP 1's per-channel scales (a row-parallel scale spans both ranks' columns)."""
    model = str(make_checkpoint(models_root, "tiny", arch))
    whole, _ = load_model(model, quantization=quantization)
    full = whole.layers[0]
    inter = full.gate_up_weight.shape[0] // 2  # [gate; up] rows of the whole model
    for rank in range(2):
        layer = _shard(model, rank, quantization).layers[0]
        for attr in ("o_weight", "down_weight"):  # row-parallel: columns, every row's scale
            mine, theirs = getattr(layer, attr), getattr(full, attr)
            cols = slice(rank * mine.shape[1], (rank + 1) * mine.shape[1])
            assert torch.equal(mine.qweight.float(), theirs.qweight[:, cols].float())
            assert torch.equal(mine.scale, theirs.scale)
        # column-parallel: the rank's gate rows, then its up rows, each with its own scale
        mine, theirs, half = layer.gate_up_weight, full.gate_up_weight, inter // 2
        rows = torch.cat(
            [torch.arange(rank * half, (rank + 1) * half), inter + torch.arange(rank * half, (rank + 1) * half)]
        )
        assert torch.equal(mine.qweight.float(), theirs.qweight[rows].float())
        assert torch.equal(mine.scale, theirs.scale[rows])


def test_each_rank_holds_its_slice_of_every_quantized_expert(models_root):
    """Mixtral, int8: every expert's down weight (row-parallel) is TP 1's columns with TP 1's scales."""
    model = str(make_checkpoint(models_root, "tiny", "mixtral"))
    whole, _ = load_model(model, quantization="int8")
    for rank in range(2):
        experts = _shard(model, rank, "int8").layers[1].moe.experts
        for mine, theirs in zip(experts, whole.layers[1].moe.experts, strict=True):
            cols = slice(rank * mine.down_weight.shape[1], (rank + 1) * mine.down_weight.shape[1])
            assert torch.equal(mine.down_weight.qweight, theirs.down_weight.qweight[:, cols])
            assert torch.equal(mine.down_weight.scale, theirs.down_weight.scale)


@pytest.mark.parametrize("stored", ["W8A16", "W4A16_ASYM", "hf-fp8"])
def test_each_rank_holds_its_slice_of_a_prequantized_checkpoint(tmp_path_factory, stored):
    """compressed-tensors grouped int8 (W8A16) and int4 (W4A16, asymmetric), and transformers'
    per-tensor fp8: each rank's row-parallel weights dequantize to TP 1's columns exactly."""
    source = make_checkpoint(tmp_path_factory.getbasetemp(), "small", "llama")  # o_proj 256, down 768 inputs
    out = tmp_path_factory.mktemp(stored)
    if stored == "hf-fp8":
        checkpoint = str(write_hf_fp8_checkpoint(source, out))
    else:
        checkpoint = str(write_compressed_checkpoint(source, out, stored))
    whole, _ = load_model(checkpoint)
    for rank in range(2):
        shard = _shard(checkpoint, rank, "none")
        for layer, full in zip(shard.layers, whole.layers, strict=True):
            for attr in ("o_weight", "down_weight"):
                mine, theirs = getattr(layer, attr).dequantize(), getattr(full, attr).dequantize()
                cols = slice(rank * mine.shape[1], (rank + 1) * mine.shape[1])
                assert torch.equal(mine, theirs[:, cols])


@READS_TRAINED_CHECKPOINT
def test_int4_ranks_hold_whole_groups_of_tp1(trained_small):
    whole, _ = load_model(trained_small, quantization="int4")
    for rank in range(2):
        mine, theirs = _shard(trained_small, rank, "int4").layers[1].down_weight, whole.layers[1].down_weight
        cols = mine.in_features
        assert mine.group_size == theirs.group_size == 128
        assert torch.equal(mine.dequantize(), theirs.dequantize()[:, rank * cols : (rank + 1) * cols])


INT4_REFUSAL = (
    "int4 quantization groups of 64 inputs cannot be split over tensor_parallel_size 2: "
    "o_proj has 64 inputs, 32 per rank"
)


def test_int4_groups_a_rank_would_split_are_refused(models_root, capsys):
    model = str(make_checkpoint(models_root, "tiny", "llama"))  # o_proj: 64 inputs, one group of 64
    with pytest.raises(ConfigError) as raised:
        LLMEngine(EngineConfig(model=model, num_kv_blocks=64, quantization="int4", tensor_parallel_size=2))
    assert str(raised.value) == INT4_REFUSAL
    result = run_cli(
        capsys, "generate", "--model", model, "--prompt", "hi", "--quantization", "int4", "--tensor-parallel-size", "2"
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"splitserve generate: error: {INT4_REFUSAL}"
