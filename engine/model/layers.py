"""One Llama-family decoder layer (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3, Mixtral,
Qwen3-MoE), with q/k/v and gate/up fused into single matmuls, or a mixture of experts as the
MLP (engine/model/moe.py); what an architecture changes is an option its registry entry turns
on (engine/model/architectures.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.architectures import SLIDING
from splitserve.engine.model.moe import SparseMoeMlp
from splitserve.engine.model.rope import RotaryEmbedding
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.attention import paged_attention, write_kv
from splitserve.engine.ops.attention_metadata import AttentionMetadata, OutputRows
from splitserve.engine.ops.sparse_decode import SparseDecodePlan
from splitserve.engine.quant.quantize import linear

if TYPE_CHECKING:
    from splitserve.engine.lora.lora_batch import LoraBatch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, cast back, then scale by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype) * weight


def rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Gemma3RMSNorm: normalise and scale by (1 + w) in fp32, then cast back."""
    return (F.rms_norm(x.float(), weight.shape, None, eps) * (1.0 + weight.float())).to(x.dtype)


MLP_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _parameter(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    """RMSNorm -> GQA self-attention over the paged cache -> RMSNorm -> SwiGLU MLP."""

    # The matmul weights; a quantized model replaces each with an engine/quant weight at load.
    LINEAR_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        dtype: torch.dtype,
        device,
        linear_device=None,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        """linear_device: where the matmul weights live until loaded; "meta" (no memory) when
        the loader quantizes them, so only one full-precision weight is ever materialised.
        Tensor parallelism: config is one rank's (engine/parallel/shard_plan.py: its heads,
        KV heads and intermediate share) and all_reduce sums the row-parallel o and down
        outputs over the ranks; None (one rank) runs no collective."""
        super().__init__()
        self.layer_index = layer_index
        arch = config.registered
        self.fused_checkpoint = arch.fused_checkpoint
        self.norm = rms_norm_plus_one if arch.norm_plus_one else rms_norm
        self.activation = MLP_ACTIVATIONS[arch.activation]
        # A sliding-window layer's queries see only the last `window` tokens (None: all); Gemma
        # 3's sliding layers also rotate by their own rope base (LlamaForCausalLM picks it).
        self.sliding = config.layer_types is not None and config.layer_types[layer_index] == SLIDING
        self.window = config.layer_window(layer_index)
        self.all_reduce = all_reduce
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate_size = config.intermediate_size
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        hidden = config.hidden_size
        qkv_rows = self.q_size + 2 * self.kv_size
        lin = device if linear_device is None else linear_device
        self.input_norm = _parameter(hidden, dtype=dtype, device=device)
        self.qkv_weight = _parameter(qkv_rows, hidden, dtype=dtype, device=lin)
        self.qkv_bias = _parameter(qkv_rows, dtype=dtype, device=device) if config.attention_bias else None
        # Qwen3: RMSNorm over each head of q and of k (head_dim wide, shared by the heads).
        self.q_norm = _parameter(self.head_dim, dtype=dtype, device=device) if config.qk_norm else None
        self.k_norm = _parameter(self.head_dim, dtype=dtype, device=device) if config.qk_norm else None
        self.o_weight = _parameter(hidden, self.q_size, dtype=dtype, device=lin)
        self.post_attention_norm = _parameter(hidden, dtype=dtype, device=device)
        # Mixtral, Qwen3-MoE's sparse layers: this layer's MLP is the experts (no dense gate/up/down weights then).
        self.moe_weight_names = arch.moe_weight_names
        self.moe = (
            SparseMoeMlp(config, dtype, device, linear_device)
            if arch.moe_weight_names is not None and layer_index in (config.moe_layers or ())
            else None
        )
        if self.moe is None:
            self.gate_up_weight = _parameter(2 * config.intermediate_size, hidden, dtype=dtype, device=lin)
            self.down_weight = _parameter(hidden, config.intermediate_size, dtype=dtype, device=lin)
        # Gemma 3: RMSNorm of the attention output and of the MLP output, before each residual add.
        self.attn_output_norm = _parameter(hidden, dtype=dtype, device=device) if arch.sandwich_norms else None
        self.mlp_output_norm = _parameter(hidden, dtype=dtype, device=device) if arch.sandwich_norms else None

    def weight_slices(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF sub-name -> (fused tensor, first row, row count) that it is loaded into."""
        q, kv, inter = self.q_size, self.kv_size, self.intermediate_size
        slices = {
            "input_layernorm.weight": (self.input_norm, 0, self.input_norm.shape[0]),
            "self_attn.o_proj.weight": (self.o_weight, 0, self.o_weight.shape[0]),
            "post_attention_layernorm.weight": (self.post_attention_norm, 0, self.post_attention_norm.shape[0]),
        }
        if self.moe is not None and self.moe_weight_names is not None:
            slices.update(self.moe.weight_slices(self.moe_weight_names))
        else:
            slices["mlp.down_proj.weight"] = (self.down_weight, 0, self.down_weight.shape[0])
        if self.attn_output_norm is not None and self.mlp_output_norm is not None:  # Gemma 3's names
            slices["pre_feedforward_layernorm.weight"] = slices.pop("post_attention_layernorm.weight")
            slices["post_attention_layernorm.weight"] = (self.attn_output_norm, 0, self.attn_output_norm.shape[0])
            slices["post_feedforward_layernorm.weight"] = (self.mlp_output_norm, 0, self.mlp_output_norm.shape[0])
        if self.fused_checkpoint:  # Phi-3: the checkpoint's tensors are already ours, row for row
            slices["self_attn.qkv_proj.weight"] = (self.qkv_weight, 0, q + 2 * kv)
            slices["mlp.gate_up_proj.weight"] = (self.gate_up_weight, 0, 2 * inter)
        else:
            slices["self_attn.q_proj.weight"] = (self.qkv_weight, 0, q)
            slices["self_attn.k_proj.weight"] = (self.qkv_weight, q, kv)
            slices["self_attn.v_proj.weight"] = (self.qkv_weight, q + kv, kv)
            if self.moe is None:
                slices["mlp.gate_proj.weight"] = (self.gate_up_weight, 0, inter)
                slices["mlp.up_proj.weight"] = (self.gate_up_weight, inter, inter)
        if self.q_norm is not None and self.k_norm is not None:
            slices["self_attn.q_norm.weight"] = (self.q_norm, 0, self.head_dim)
            slices["self_attn.k_norm.weight"] = (self.k_norm, 0, self.head_dim)
        if self.qkv_bias is not None:
            slices.update(
                {
                    "self_attn.q_proj.bias": (self.qkv_bias, 0, q),
                    "self_attn.k_proj.bias": (self.qkv_bias, q, kv),
                    "self_attn.v_proj.bias": (self.qkv_bias, q + kv, kv),
                }
            )
        return slices

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        on_kv_written: Callable[[int], None] | None = None,
        decode_plan: SparseDecodePlan | None = None,
        lora: LoraBatch | None = None,
        output_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; writes this layer's new K/V into the cache.
        lora: each adapter token's LoRA delta added to every targeted projection's output.
        output_rows (the last layer, without LoRA): once every row's K/V is written, only
        these rows go on; returns [R, hidden]."""
        x = self.norm(hidden, self.input_norm, self.eps)
        num_tokens = x.shape[0]
        i = self.layer_index
        qkv = linear(x, self.qkv_weight, self.qkv_bias)
        if lora is not None:  # q, k and v are column ranges of the fused output, in that order
            lora.add_delta(qkv, i, "qkv", x)
        # Rotate q and k in one go: they are adjacent columns of the fused projection.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            heads = self.num_heads
            qk = torch.cat(
                (self.norm(qk[:, :heads], self.q_norm, self.eps), self.norm(qk[:, heads:], self.k_norm, self.eps)), 1
            )
        qk = RotaryEmbedding.apply(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        write_kv(key_cache, value_cache, k, v, meta.slot_mapping)
        if on_kv_written is not None:
            on_kv_written(self.layer_index)
        if output_rows is not None:
            if output_rows.meta is None:
                return hidden[:0]
            # Each row a decode query over its own context (OutputRows); its own K/V is in the cache.
            q, hidden = q.index_select(0, output_rows.index), hidden.index_select(0, output_rows.index)
            meta, decode_plan = output_rows.meta, None
        attn = paged_attention(
            q, key_cache, value_cache, meta, self.scale, k, v, decode_plan=decode_plan, window=self.window
        )
        # Residual adds in place on the fresh matmul outputs (x + r == r + x exactly); under
        # tensor parallelism after the partial outputs are summed, so the residual counts once.
        attn = attn.reshape(q.shape[0], self.q_size)
        out = linear(attn, self.o_weight)
        if lora is not None:
            lora.add_delta(out, i, "o", attn)
        if self.all_reduce is not None:
            self.all_reduce(out)
        if self.attn_output_norm is not None:
            out = self.norm(out, self.attn_output_norm, self.eps)
        hidden = out.add_(hidden)

        x = self.norm(hidden, self.post_attention_norm, self.eps)
        if self.moe is not None:  # tensor parallelism: each rank's share of every expert
            out = self.moe(x, self.activation)
        else:
            gate_up = linear(x, self.gate_up_weight)
            if lora is not None:
                lora.add_delta(gate_up, i, "gate_up", x)
            act = self.activation(gate_up[:, : self.intermediate_size]).mul_(gate_up[:, self.intermediate_size :])
            out = linear(act, self.down_weight)
            if lora is not None:
                lora.add_delta(out, i, "down", act)
        if self.all_reduce is not None:
            self.all_reduce(out)
        if self.mlp_output_norm is not None:
            out = self.norm(out, self.mlp_output_norm, self.eps)
        return out.add_(hidden)
