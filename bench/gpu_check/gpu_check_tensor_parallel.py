"""gpu_check check 10: tensor parallelism (engine/parallel/) on the device.

The lent machine has one GPU, so only a one-rank group runs there: NCCL's collectives
(all-reduce, broadcast, gather to the driver) on a group of size 1, and the sharded model's
code path (vocabulary-parallel embedding and logits, the row-parallel all-reduces) on that
group against the whole model. The shards of TP 2 and 4 are loaded (no collective runs at
load) and checked to tile the checkpoint's tensors exactly. TP 2 greedy parity across
processes runs on CPU gloo in tests/engine/test_tensor_parallel.py; on a node with two GPUs
`splitserve generate --tensor-parallel-size 2 --device cuda` runs it on NCCL.

group       a size-1 group's collectives on the device (NCCL on CUDA, gloo on CPU) leave the values
sharded     the sharded model on that group: prefill hidden states and logits vs the whole model
shapes      TP 2 and 4 shards (KV heads split and replicated) tile q/k/v, o, gate/up, down, embedding
"""

from __future__ import annotations

import contextlib
import os
import types
from pathlib import Path

import torch

from splitserve.bench.gpu_check.gpu_check_ops import item
from splitserve.bench.gpu_check.gpu_check_throughput import TINY, write_llama

# fp32: a one-rank group sums nothing, so the sharded path should be the whole model's exactly.
TOLERANCE = 1e-5


def _one_rank_group(config, device: torch.device):
    import torch.distributed as dist

    from splitserve.engine.parallel.shard_plan import ShardPlan
    from splitserve.engine.parallel.tp_group import TensorParallelGroup

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    return TensorParallelGroup.join(ShardPlan(config, 1, 0), device, store, "127.0.0.1", 60.0), store


def _group_items(group, device: torch.device) -> list[dict]:
    values = torch.arange(8, dtype=torch.float32, device=device)
    reduced = group.all_reduce(values.clone())
    sent = group.broadcast(values.clone())
    gathered = group.gather_to_driver(values.clone())
    exact = torch.equal(reduced, values) and torch.equal(sent, values) and torch.equal(gathered[0], values)
    backend = "nccl" if device.type == "cuda" else "gloo"
    return [item(f"{backend} size-1 group", "pass" if exact else "fail", "all-reduce, broadcast, gather")]


def _prefill(model, device: torch.device, prompt_len: int):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.ops.attention_metadata import AttentionMetadata
    from splitserve.engine.ops.kv_cache import KVCache

    layer_config = model.tensor_parallel.plan.local_config if model.tensor_parallel is not None else model.config
    blocks = -(-prompt_len // 16)
    engine_config = EngineConfig(model="unused", num_kv_blocks=max(blocks, 2), device=str(device), dtype="float32")
    cache = KVCache(layer_config, engine_config)
    ids = torch.arange(prompt_len, device=device) % model.config.vocab_size
    meta = AttentionMetadata.build(
        list(range(prompt_len)), [0, prompt_len], [prompt_len], [list(range(blocks))], prompt_len, device
    )
    hidden = model(ids, torch.arange(prompt_len, device=device), cache, meta)
    return hidden, model.compute_logits(hidden[-4:])


def _sharded_items(path: Path, config, group, device: torch.device) -> list[dict]:
    from splitserve.engine.model.loader import load_model

    whole, _ = load_model(path, dtype="float32", device=device)
    shard, _ = load_model(path, dtype="float32", device=device, tensor_parallel=group)
    hidden, logits = _prefill(whole, device, 40)
    shard_hidden, shard_logits = _prefill(shard, device, 40)
    hidden_err = (hidden - shard_hidden).abs().max().item()
    logits_err = (logits - shard_logits).abs().max().item()
    ok = hidden_err <= TOLERANCE and logits_err <= TOLERANCE and shard_logits.shape == logits.shape
    return [
        item(
            "sharded model on a 1-rank group",
            "pass" if ok else "fail",
            f"prefill of 40 tokens, logits {tuple(shard_logits.shape)}",
            hidden_max_abs=hidden_err,
            logits_max_abs=logits_err,
        )
    ]


@contextlib.contextmanager
def _plain_cpu_weights():
    from splitserve.engine.ops.onednn_packed_weight import CPU_MATMUL_ENV

    before = os.environ.get(CPU_MATMUL_ENV)
    os.environ[CPU_MATMUL_ENV] = "blas"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CPU_MATMUL_ENV)
        else:
            os.environ[CPU_MATMUL_ENV] = before


def _shards(path: Path, config, size: int, device: torch.device) -> list:
    """Each rank's shard, built with a stand-in group: loading runs no collective."""
    from splitserve.engine.model.loader import load_model
    from splitserve.engine.parallel.shard_plan import ShardPlan

    shards = []
    for rank in range(size):
        group = types.SimpleNamespace(plan=ShardPlan(config, size, rank), size=size, rank=rank, all_reduce=None)
        shards.append(load_model(path, dtype="float32", device=device, tensor_parallel=group)[0])
    return shards


def _shape_items(path: Path, config, device: torch.device) -> list[dict]:
    """TP 2 and 4 shards tile the whole model's tensors; KV rows split, or replicated alike."""
    from splitserve.engine.model.loader import load_model

    with _plain_cpu_weights():  # oneDNN-packed weights cannot be sliced and compared
        whole, _ = load_model(path, dtype="float32", device=device)
        shards_by_size = {size: _shards(path, config, size, device) for size in (2, 4)}
    layer = whole._layer_list[0]
    q, kv, inter = layer.q_size, layer.kv_size, layer.intermediate_size
    items = []
    for size, shards in shards_by_size.items():
        layers = [s._layer_list[0] for s in shards]
        sq = layers[0].q_size
        tiled = {
            "q": torch.cat([lay.qkv_weight[:sq] for lay in layers]).equal(layer.qkv_weight[:q]),
            "o": torch.cat([lay.o_weight for lay in layers], dim=1).equal(layer.o_weight),
            "gate": torch.cat([lay.gate_up_weight[: inter // size] for lay in layers]).equal(
                layer.gate_up_weight[:inter]
            ),
            "down": torch.cat([lay.down_weight for lay in layers], dim=1).equal(layer.down_weight),
            "embed": _embedding_ok(shards, whole, config.vocab_size),
        }
        replicas = max(size // config.num_key_value_heads, 1)
        k_rows = [lay.qkv_weight[sq : sq + lay.kv_size] for lay in layers]
        kv_ok = torch.cat(k_rows[::replicas]).equal(layer.qkv_weight[q : q + kv])
        kv_ok = kv_ok and all(k_rows[r].equal(k_rows[r - r % replicas]) for r in range(size))
        ok = all(tiled.values()) and kv_ok
        kind = "replicated" if size > config.num_key_value_heads else "split"
        bad = [name for name, good in tiled.items() if not good] + ([] if kv_ok else ["k"])
        items.append(
            item(f"TP {size} shards tile the model", "pass" if ok else "fail", f"KV heads {kind}; wrong: {bad}")
        )
    return items


def _embedding_ok(shards: list, whole, vocab_size: int) -> bool:
    """Each shard's embedding is the whole table where the plan replicates it (a small untied
    one), else its vocabulary rows: together they tile the table."""
    if shards[0].tensor_parallel.plan.replicated_embedding:
        return all(s.embed_tokens.equal(whole.embed_tokens) for s in shards)
    return torch.cat([s.embed_tokens for s in shards])[:vocab_size].equal(whole.embed_tokens)


def check_tensor_parallel(device: torch.device, tiny: bool, work_dir: Path) -> dict:
    from splitserve.engine.model_config import ModelConfig

    shape = dict(TINY) if tiny else dict(TINY, hidden_size=1024, intermediate_size=2816, num_attention_heads=16)
    path, _ = write_llama(work_dir / "llama-tp", shape, device)
    config = ModelConfig.from_pretrained(path)
    group, store = _one_rank_group(config, device)
    try:
        items = _group_items(group, device)
        items += _sharded_items(path, config, group, device)
    finally:
        group.shutdown()
        del store
    items += _shape_items(path, config, device)
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    items.append(
        item(
            "TP 2 across processes",
            "info",
            f"{gpus} GPU(s) here; TP 2 greedy parity runs on CPU gloo (tests/engine/test_tensor_parallel.py)",
        )
    )
    return {"items": items}
