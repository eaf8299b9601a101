"""Tensor parallelism in the colocated engine (engine/parallel/): greedy TP=2 output equals
TP=1 token for token and log-probability for log-probability (within float-reduction noise) on
make-model checkpoints whose heads split evenly, whose one KV head is replicated (TP > KV
heads), with Qwen2's q/k/v bias and with an int8 KV cache; a TP size that cannot split a model
is a one-line error; the ranks stop with the engine, with the CLI, and when the driver is killed.
Two gloo ranks on two shared cores: correctness only, no timing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.builtin_models.model_spec import ModelSpec
from splitserve.engine.config import ConfigError, EngineConfig
from splitserve.engine.engine_errors import EngineStepError
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.parallel.shard_plan import ShardPlan, check_tensor_parallel_size
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cli import run_cli
from tests.helpers.model import READS_TRAINED_CHECKPOINT, make_checkpoint

# fp32; the row-parallel sums add the ranks' partial dot products in another order than one
# matmul does, so log-probabilities may differ in the last bits, never by more than this.
LOGPROB_TOL = 1e-4
PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 100, 3, 8, 12], [7, 7, 19], list(range(20, 60))]


def _config(model: str, tp: int, **kwargs) -> EngineConfig:
    return EngineConfig(model=model, num_kv_blocks=64, tensor_parallel_size=tp, **kwargs)


def _greedy(engine: LLMEngine, prompts=PROMPTS, max_tokens: int = 12, prompt_logprobs: int | None = 2):
    """Greedy outputs with log-probabilities (prompt ones too: a logits call per prompt chunk,
    which reads no cached prefix)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=3,
        prompt_logprobs=prompt_logprobs,
    )
    return engine.generate(prompts, params)


def _assert_same(tp1, tp2) -> None:
    for one, two in zip(tp1, tp2):
        assert two.token_ids == one.token_ids
        assert [t for t, _ in two.top_logprobs[0]] == [t for t, _ in one.top_logprobs[0]]
        for a, b in zip(one.logprobs + one.prompt_logprobs, two.logprobs + two.prompt_logprobs):
            assert abs(a - b) <= LOGPROB_TOL


@pytest.mark.parametrize(
    ("preset", "arch", "kv_cache_dtype"),
    [
        ("tiny", "llama", "auto"),  # 4 heads, 2 KV heads: one KV head per rank
        ("draft", "llama", "auto"),  # 2 heads, 1 KV head: replicated on both ranks
        ("tiny", "qwen2", "auto"),  # q/k/v bias, sharded with their rows
        ("draft", "qwen3", "auto"),  # q/k norms (whole on every rank), KV head replicated
        ("tiny", "phi3", "auto"),  # fused qkv_proj / gate_up_proj: each rank reads its parts' rows
        ("draft", "phi3", "auto"),  # fused, with the one KV head replicated
        ("tiny", "gemma3", "auto"),  # (1 + w) and sandwich norms whole per rank, soft-capped logits gathered
        ("tiny", "llama", "int8"),  # the quantized KV cache holds each rank's heads and scales
    ],
)
def test_tp2_greedy_equals_tp1(models_root, preset, arch, kv_cache_dtype):
    model = str(make_checkpoint(models_root, preset, arch))
    reference = _greedy(LLMEngine(_config(model, 1, kv_cache_dtype=kv_cache_dtype)))
    engine = LLMEngine(_config(model, 2, kv_cache_dtype=kv_cache_dtype))
    try:
        plan = engine.tensor_parallel.group.plan
        assert engine.kv_cache.num_kv_heads == plan.num_kv_heads  # this rank's KV heads only
        _assert_same(reference, _greedy(engine))
        again = _greedy(engine, prompt_logprobs=None)  # the same prompts again: prefix-cache hits
        assert again[2].num_cached_tokens >= 32  # its 40-token prompt: two full blocks hit
        _assert_same(reference, again)
    finally:
        engine.close()


@pytest.mark.slow  # trains the model (about 100 s of CPU) where the shared cache lacks it
@READS_TRAINED_CHECKPOINT
@pytest.mark.parametrize("preset", ["small", "draft"])  # KV heads split / replicated
def test_tp2_greedy_text_equals_tp1_on_the_trained_models(preset):
    model = str(cached_checkpoint(ModelSpec(preset, "llama", seed=0, train_steps=300)).path)
    prompts = ["Hello, how are you today?", "The river runs"]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True)
    reference = LLMEngine(_config(model, 1)).generate(prompts, params)
    engine = LLMEngine(_config(model, 2))
    try:
        sharded = engine.generate(prompts, params)
    finally:
        engine.close()
    for one, two in zip(reference, sharded):
        assert (two.token_ids, two.text) == (one.token_ids, one.text)
        assert max(abs(a - b) for a, b in zip(one.logprobs, two.logprobs)) <= LOGPROB_TOL


def test_kv_heads_are_replicated_when_tp_exceeds_them(models_root):
    config = ModelConfig.from_pretrained(make_checkpoint(models_root, "tiny", "llama"))  # 4 heads, 2 KV heads
    plans = [ShardPlan(config, 4, rank) for rank in range(4)]
    assert [p.kv_head_start for p in plans] == [0, 0, 1, 1] and {p.num_kv_heads for p in plans} == {1}
    # Rank r's query heads are those that read its KV head (head h reads KV head h // 2).
    for plan in plans:
        q_start = plan.checkpoint_slice("model.layers.0.self_attn.q_proj.weight")[1] // config.head_dim
        assert q_start // 2 == plan.kv_head_start
    even = [ShardPlan(config, 2, rank) for rank in range(2)]
    assert [p.kv_head_start for p in even] == [0, 1]
    # Column- and row-parallel slices tile the tensors, and the vocabulary rows too.
    down = [p.checkpoint_slice("model.layers.1.mlp.down_proj.weight") for p in even]
    assert down == [(1, 0, 64), (1, 64, 128)]
    assert [p.checkpoint_slice("lm_head.weight") for p in even] == [(0, 0, 256), (0, 256, 512)]
    assert even[0].checkpoint_slice("model.layers.0.input_layernorm.weight") is None


def test_a_fused_tensor_gives_each_rank_its_rows_of_every_part(models_root):
    """Phi-3's qkv_proj [q; k; v] and gate_up_proj [gate; up]: a rank reads its q heads, its KV
    heads' k and v, its gate and up rows, each at its part's offset in the fused tensor."""
    config = ModelConfig.from_pretrained(make_checkpoint(models_root, "tiny", "phi3"))  # 4 heads, 2 KV, head 16
    layer = "model.layers.0."
    for tp, rank in [(2, 0), (2, 1), (4, 3)]:
        plan = ShardPlan(config, tp, rank)
        q, k, v = (plan.checkpoint_slice(layer + f"self_attn.{n}_proj.weight") for n in "qkv")
        assert plan.checkpoint_slice(layer + "self_attn.qkv_proj.weight") == [
            q,
            (0, 64 + k[1], 64 + k[2]),
            (0, 96 + v[1], 96 + v[2]),
        ]
        gate, up = (plan.checkpoint_slice(layer + f"mlp.{n}_proj.weight") for n in ("gate", "up"))
        assert plan.checkpoint_slice(layer + "mlp.gate_up_proj.weight") == [gate, (0, 128 + up[1], 128 + up[2])]
    assert ShardPlan(config, 2, 1).checkpoint_slice(layer + "self_attn.qkv_proj.weight") == [
        (0, 32, 64),
        (0, 80, 96),
        (0, 112, 128),
    ]


@pytest.mark.parametrize(
    ("tp", "message"),
    [
        (3, "tensor_parallel_size 3 does not divide num_attention_heads 4"),
        (8, "tensor_parallel_size 8 does not divide num_attention_heads 4"),
    ],
)
def test_a_tp_size_that_does_not_split_the_model_is_a_one_line_error(models_root, capsys, tp, message):
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    with pytest.raises(ConfigError, match=message):
        LLMEngine(_config(model, tp))
    result = run_cli(capsys, "generate", "--model", model, "--prompt", "hi", "--tensor-parallel-size", str(tp))
    assert result.returncode == 2
    assert result.stderr.strip() == f"splitserve generate: error: {message}"


def test_kv_heads_and_intermediate_size_that_cannot_split_are_named():
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=48, num_hidden_layers=1, head_dim=8)
    config = ModelConfig(
        **base, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=64
    )
    with pytest.raises(
        ConfigError, match="tensor_parallel_size 2 and num_key_value_heads 3: one must divide the other"
    ):
        check_tensor_parallel_size(config, 2)
    config = ModelConfig(
        **base, intermediate_size=90, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64
    )
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 does not divide intermediate_size 90"):
        check_tensor_parallel_size(config, 4)


def test_a_tp_size_below_one_is_refused_by_name(models_root):
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    with pytest.raises(ConfigError, match="tensor_parallel_size must be an integer >= 1, got 0"):
        _config(model, 0)


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_close_stops_the_ranks(models_root):
    engine = LLMEngine(_config(str(make_checkpoint(models_root, "tiny", "llama")), 2))
    pids = engine.tensor_parallel.pids
    assert pids and all(_alive(pid) for pid in pids)
    engine.close()
    assert not any(_alive(pid) for pid in pids)  # joined: not even a zombie is left


def test_a_dead_rank_fails_the_step_and_every_later_one(models_root):
    engine = LLMEngine(_config(str(make_checkpoint(models_root, "tiny", "llama")), 2, tensor_parallel_timeout_s=30))
    try:
        follower = engine.tensor_parallel._processes[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(10)
        # The forward goes through the step mailbox (shared memory: no pipe write to fail), so
        # the first all-reduce finds the rank's process gone; over a pipe the write fails.
        with pytest.raises(EngineStepError, match=r"tensor-parallel rank 1 is gone|rank 1 \(pid \d+\) exited"):
            engine.generate([[5, 6, 7]])
        with pytest.raises(EngineStepError, match="stopped after a failed step"):
            engine.generate([[5, 6, 7]])  # at once: no collective is waited for
    finally:
        engine.close()


def test_the_cli_leaves_no_process_behind(models_root):
    """`generate --tensor-parallel-size 2` in a session of its own: once it exits, nothing of
    that session is left (the ranks and multiprocessing's helper included)."""
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    argv = ["generate", "--model", model, "--prompt-token-ids", "5,6,7", "--max-tokens", "4", "-tp", "2", "--json"]
    code = "import sys; from splitserve.cluster.cli.main import main; sys.exit(main(sys.argv[1:]))"
    cli = subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out, err = cli.communicate(timeout=300)
    assert cli.returncode == 0, err[-2000:]
    assert '"token_ids"' in out
    # The CLI's process led its own session: its pid is the process group's id.
    assert _wait_group_gone(cli.pid, 20), "a process of the generate run outlived it"


def test_the_ranks_exit_when_the_driver_is_killed(models_root, tmp_path):
    model = str(make_checkpoint(models_root, "tiny", "llama"))
    script = textwrap.dedent(
        f"""
        import sys, time
        from splitserve.engine.config import EngineConfig
        from splitserve.engine.llm_engine import LLMEngine
        engine = LLMEngine(EngineConfig(model={model!r}, num_kv_blocks=64, tensor_parallel_size=2))
        engine.generate([[5, 6, 7]])
        print(*engine.tensor_parallel.pids, flush=True)
        time.sleep(300)
        """
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert pids and all(_alive(pid) for pid in pids)
        driver.send_signal(signal.SIGKILL)  # no clean-up can run in the driver
        driver.wait(30)
        assert _wait_group_gone(driver.pid, 30), "a rank outlived its killed driver"
    finally:
        if driver.poll() is None:
            driver.kill()
