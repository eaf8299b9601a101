"""TensorParallelModel: the driver's sharded model as ModelRunner uses a model. Each forward and
each logits call first hands the same work to the follower ranks (tp_ranks.py), then runs the
driver's shard; the collectives inside pair the ranks up. Whatever calls the model -- a step,
prompt log-probabilities, a speculative verification -- is mirrored on every rank the same way.
There is no scripted decode step (its one TorchScript call has no place for the collectives):
a tensor-parallel engine runs the eager step.

A forward whose caller names the rows it will take logits of next (logits_rows: ModelRunner's
step does) carries them in its command, where the gather goes over shared memory (a CPU group), so each follower computes its vocabulary rows' logits
from its own copy of the final hidden states (every rank's is the same: the all-reduces sum in
rank order) right after its forward, and the driver's compute_logits for those rows sends
nothing: one command per step instead of two, and no broadcast of the hidden rows
(bench/results/tensor_parallel.md). Any other logits call (prompt log-probabilities, a draft
model's) is its own command, as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_sizing import resolve_num_kv_blocks
from splitserve.engine.model.checkpoint import require_model_dir
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.loader import load_model
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.parallel import shard_plan
from splitserve.engine.parallel.follower_extension import FollowerExtensionFactory, rank_work_of
from splitserve.engine.parallel.tp_ranks import FollowerLauncher, TensorParallelRanks


class TensorParallelModel:
    _scripted_decode = None  # ModelRunner's check: the eager step
    takes_logits_rows = True  # ModelRunner's check: a forward may name its logits rows

    def __init__(self, shard: LlamaForCausalLM, ranks: TensorParallelRanks):
        self.shard = shard
        self.ranks = ranks
        self.config = shard.config
        # How many rows the followers' logits already went out for (a forward's logits_rows),
        # awaiting the driver's compute_logits of the same rows; None: none pending.
        self._announced_rows: int | None = None

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def dtype(self) -> torch.dtype:
        return self.shard.dtype

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
        logits_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """logits_rows: the rows of the result whose logits the next compute_logits call takes
        (hidden.index_select(0, rows)); the followers then compute theirs with this forward."""
        self.ranks.pinned.pin_calling_thread()  # once per thread: rank 0's core (rank_cpus.py)
        with self.ranks.lock, self.ranks.stop_on_failure():
            self.ranks.check_running()  # before any collective: a stopped group pairs with no rank
            self._drain_announced()
            if logits_rows and not self._gather_never_waits(len(logits_rows)):
                logits_rows = None
            self.ranks.send_forward(input_ids, positions, meta, rank_work_of(on_layer_done), logits_rows)
            if logits_rows:
                self._announced_rows = len(logits_rows)
            return self.shard(input_ids, positions, kv_cache, meta, on_layer_done=on_layer_done)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.ranks.lock, self.ranks.stop_on_failure():
            self.ranks.check_running()
            if self._announced_rows is not None and self._announced_rows == hidden.shape[0]:
                self._announced_rows = None  # the followers' share went out with the forward
                return self.shard.compute_logits(hidden)
            self._drain_announced()
            return self.shard.compute_logits(self.ranks.send_logits(hidden))

    def _gather_never_waits(self, rows: int) -> bool:
        """Whether a follower's logits gather of rows returns without the driver's part: over
        shared memory it does (it only publishes its slot). Over gloo or NCCL it could hold the
        follower's pipe loop until the driver's compute_logits, and a command the driver sends
        in between (the KV plane's) would wait on it: those logits stay a command of their own."""
        shm = self.ranks.group.shm
        return shm is not None and rows * self.ranks.group.plan.vocab_rows * 4 <= shm.slot_bytes  # float32

    def _drain_announced(self) -> None:
        """Take the followers' logits of an announced forward that no compute_logits took (its
        step failed in between): every rank must run the same collectives in the same order."""
        rows, self._announced_rows = self._announced_rows, None
        if rows is not None:
            vocab_rows = self.ranks.group.plan.vocab_rows
            self.ranks.group.gather_to_driver(torch.empty(rows, vocab_rows, dtype=torch.float32, device=self.device))


def launch_tensor_parallel(
    config: EngineConfig, launch: FollowerLauncher | None = None, extension: FollowerExtensionFactory | None = None
) -> tuple[EngineConfig, TensorParallelModel, ModelConfig, ModelConfig]:
    """Check config against the model, spawn the follower ranks (launch: have it start them;
    extension: what each runs beside its forward), load rank 0's shard and wait for theirs. Returns the config with its KV block count resolved (per rank: its KV heads'
    bytes), the driver's model, the whole model's config and one rank's (its KV cache's)."""
    shard_plan.refuse_unsupported(config)
    model_config = ModelConfig.from_pretrained(require_model_dir(config.model))
    if config.dtype is not None:
        model_config.dtype = config.dtype
    plan = shard_plan.ShardPlan(model_config, config.tensor_parallel_size, 0)
    shard_plan.check_quantized_split(model_config, plan.size, config.quantization)  # before any rank starts
    local = plan.local_config
    max_model_len = min(config.max_model_len or model_config.max_context_len, model_config.max_context_len)
    blocks = resolve_num_kv_blocks(
        local,
        config.block_size,
        config.kv_cache_dtype,
        config.dtype,
        config.num_kv_blocks,
        config.kv_cache_memory_bytes,
        max_model_len,
    )
    config = dataclasses.replace(config, num_kv_blocks=blocks)
    ranks = TensorParallelRanks(config, plan, launch, extension)
    try:
        shard, model_config = load_model(
            config.model,
            dtype=config.dtype,
            device=ranks.group.device,
            quantization=config.quantization,
            tensor_parallel=ranks.group,
        )
        ranks.wait_ready()
    except BaseException:
        ranks.close()
        raise
    return config, TensorParallelModel(shard, ranks), model_config, local
