"""ShardPlan: what one tensor-parallel rank holds of a Llama-family model, and which slice of
each checkpoint tensor it reads. Torch-free: the driver checks a TP size before it spawns a rank.

Megatron's split (as vLLM does it): q/k/v and gate/up are column-parallel (each rank its heads'
rows, its share of the intermediate rows), o and down row-parallel (the matching input
columns; one all-reduce each sums the partial outputs), embedding and lm_head split by
vocabulary rows -- except a small untied embedding, which every rank holds whole
(replicated_embedding: its lookup then needs no all-reduce). A mixture of experts splits every expert's intermediate dimension the same way
(each rank a slice of every expert; the router whole on each, so every rank routes alike). When the TP size exceeds the KV heads (GQA), each KV head is replicated on
TP / kv_heads ranks: rank r holds KV head r // (TP / kv_heads), the one its query heads read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from splitserve.engine.config import CPU_DECODE_FORWARD_ENV, ConfigError, EngineConfig
from splitserve.engine.model.checkpoint import TensorSlice
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.quant.int4_groups import group_size_for

_Q = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
_KV = ("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias")
_MLP_IN = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_EMBED, _LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# An untied embedding table up to this many parameters (32 MiB in 16 bits, 64 MiB in fp32) is
# held whole by every rank: its lookup then needs no all-reduce, one collective fewer per step,
# for at most that much memory per rank. Larger tables (any real model's: Llama-2-7B's has 131M)
# stay vocabulary-parallel; a tied table is also lm_head, which stays vocabulary-parallel.
REPLICATED_EMBEDDING_MAX_PARAMS = 1 << 24
# Phi-3's fused tensors and the unfused ones they stack, in row order.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.gate_up_proj.weight": _MLP_IN,
}


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> range:
    """The KV heads (of the whole model's) rank holds of size ranks: an equal share, or, when
    size exceeds them, the one head its size // num_kv_heads ranks share."""
    if size > num_kv_heads:
        head = rank // (size // num_kv_heads)
        return range(head, head + 1)
    share = num_kv_heads // size
    return range(rank * share, (rank + 1) * share)


def refuse_unsupported(config: EngineConfig, environ: Mapping[str, str] = os.environ) -> None:
    """What a tensor-parallel engine does not do, refused by name in one line. The scripted CPU
    decode step is one TorchScript call with no place for the collectives: a TP engine runs the
    eager step, and asking for the scripted one by name is refused rather than ignored."""
    size = config.tensor_parallel_size
    scripted = environ.get(CPU_DECODE_FORWARD_ENV, "").strip().lower() == "scripted"
    refused = {
        f"the scripted CPU decode step ({CPU_DECODE_FORWARD_ENV}=scripted; unset it or set eager)": scripted
        and not str(config.device).startswith("cuda"),
    }
    for what, applies in refused.items():
        if size > 1 and applies:
            raise ConfigError(f"tensor_parallel_size {size} does not support {what}")


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """A one-line ConfigError naming the numbers when size cannot split this model."""
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if config.num_experts and config.moe_intermediate_size % size:  # every expert's share of it
        raise ConfigError(
            f"tensor_parallel_size {size} does not divide moe_intermediate_size {config.moe_intermediate_size}"
        )
    if heads % size:
        raise ConfigError(f"tensor_parallel_size {size} does not divide num_attention_heads {heads}")
    if kv_heads % size and size % kv_heads:
        raise ConfigError(
            f"tensor_parallel_size {size} and num_key_value_heads {kv_heads}: one must divide the other "
            "(KV heads are split, or replicated when TP exceeds them)"
        )
    if inter % size:
        raise ConfigError(f"tensor_parallel_size {size} does not divide intermediate_size {inter}")


def check_quantized_split(config: ModelConfig, size: int, quantization: str) -> None:
    """Quantization groups run along a weight's inputs; a row-parallel weight (o_proj, down_proj)
    gives each rank 1/size of its inputs, which must be whole groups (engine/parallel/
    quantized_shards.py). A one-line ConfigError naming the numbers when they are not.
    Per-channel scales (int8, fp8) split whatever the size."""
    stored = config.checkpoint_scheme  # a pre-quantized checkpoint's groups are its own
    if size == 1 or (stored is None and quantization != "int4"):
        return
    if stored is not None and stored.strategy != "group":
        return
    scheme = "int4" if stored is None else stored.scheme
    inputs = {"o_proj": config.num_attention_heads * config.head_dim, "down_proj": config.intermediate_size}
    if config.num_experts:
        inputs["the experts' down_proj"] = config.moe_intermediate_size
    for projection, width in inputs.items():
        try:
            group = group_size_for(width) if stored is None else stored.group_size
        except ValueError:
            continue  # int4 cannot hold this layer at any TP size: the load says so
        if group and (width // size) % group:
            raise ConfigError(
                f"{scheme} quantization groups of {group} inputs cannot be split over tensor_parallel_size "
                f"{size}: {projection} has {width} inputs, {width // size} per rank"
            )


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig  # the whole model's
    size: int
    rank: int

    def __post_init__(self) -> None:
        check_tensor_parallel_size(self.config, self.size)
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"rank {self.rank} is outside tensor_parallel_size {self.size}")

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return len(kv_head_range(self.config.num_key_value_heads, self.size, self.rank))

    @property
    def kv_head_start(self) -> int:
        return kv_head_range(self.config.num_key_value_heads, self.size, self.rank).start

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's embedding / lm_head: the vocabulary split in equal parts, the
        last one padded (its padding rows are never looked up and their logits are cut)."""
        return -(-self.config.vocab_size // self.size)

    @property
    def replicated_embedding(self) -> bool:
        """Whether every rank holds the whole embedding table (REPLICATED_EMBEDDING_MAX_PARAMS)."""
        config = self.config
        small = config.vocab_size * config.hidden_size <= REPLICATED_EMBEDDING_MAX_PARAMS
        return self.size > 1 and small and not config.tie_word_embeddings

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def vocab_rows_loaded(self) -> int:
        """The real vocabulary rows of this rank (fewer than vocab_rows on the last rank)."""
        return max(min(self.vocab_rows, self.config.vocab_size - self.vocab_start), 0)

    @property
    def local_config(self) -> ModelConfig:
        """The model config one rank builds its layers and its KV cache from: its heads, KV
        heads and intermediate share; hidden size and vocabulary as the whole model's."""
        return dataclasses.replace(
            self.config,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            moe_intermediate_size=self.config.moe_intermediate_size // self.size,
        )

    def checkpoint_slice(self, name: str) -> TensorSlice | None:
        """(dim, start, stop) of the checkpoint tensor `name` this rank reads; None: all of it
        (norms, which every rank holds whole). A fused tensor (Phi-3's qkv_proj, gate_up_proj)
        gives a list: this rank's rows of each part (q, k, v; gate, up), in that order, which
        is how the rank's own fused weight holds them."""
        if name.endswith(_EMBED) and self.replicated_embedding:
            return None
        if name.endswith((_EMBED, _LM_HEAD)):
            return 0, self.vocab_start, self.vocab_start + self.vocab_rows_loaded
        sub = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        if sub in _FUSED:
            pieces, offset = [], 0
            for part, part_rows in zip(_FUSED[sub], self._fused_part_rows(sub)):
                cut = self._unfused_slice(part)
                assert cut is not None  # every part is a row-split tensor
                dim, start, stop = cut
                pieces.append((dim, offset + start, offset + stop))
                offset += part_rows
            return pieces
        return self._unfused_slice(sub)

    def _fused_part_rows(self, sub: str) -> tuple[int, ...]:
        """The rows of each part of a fused checkpoint tensor in the whole model."""
        if sub == "self_attn.qkv_proj.weight":
            kv_rows = self.config.num_key_value_heads * self.config.head_dim
            return self.config.num_attention_heads * self.config.head_dim, kv_rows, kv_rows
        return self.config.intermediate_size, self.config.intermediate_size

    def _unfused_slice(self, sub: str) -> tuple[int, int, int] | None:
        head_dim = self.config.head_dim
        if sub in _Q:
            start = self.rank * self.num_heads * head_dim
            return 0, start, start + self.num_heads * head_dim
        if sub in _KV:
            start = self.kv_head_start * head_dim
            return 0, start, start + self.num_kv_heads * head_dim
        if sub == "self_attn.o_proj.weight":
            start = self.rank * self.num_heads * head_dim
            return 1, start, start + self.num_heads * head_dim
        if sub in _MLP_IN:
            start = self.rank * self.intermediate_size
            return 0, start, start + self.intermediate_size
        if sub == "mlp.down_proj.weight":
            start = self.rank * self.intermediate_size
            return 1, start, start + self.intermediate_size
        return self._expert_slice(sub)

    def _expert_slice(self, sub: str) -> tuple[int, int, int] | None:
        """A mixture of experts: each expert's gate and up rows, and its down columns, split as a
        dense MLP's (every rank its share of every expert); the router whole on every rank."""
        names = self.config.registered.moe_weight_names
        if names is None or not self.config.num_experts:
            return None
        block, gate, up, down = names
        prefix = f"{block}.experts."
        if not sub.startswith(prefix):
            return None  # the router (or a dense layer's MLP, split above)
        projection = sub[len(prefix) :].partition(".")[2]
        share = self.config.moe_intermediate_size // self.size
        start = self.rank * share
        if projection in (f"{gate}.weight", f"{up}.weight"):
            return 0, start, start + share
        if projection == f"{down}.weight":
            return 1, start, start + share
        return None
