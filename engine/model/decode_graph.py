"""DecodeGraph: the CPU pure-decode forward pass (and a greedy step's argmax) as a TorchScript
module, op for op the eager model's (engine/model/layers.py, rope.py, ops/attention.py's
write_kv, ops/sparse_decode.py, engine/model_runner.py's placeholder fill, compute_logits and
the sampler's argmax): the same kernels in the same order, so the same bits.

Why a module and a `pinned` list: TorchScript runs a graph with the GIL released, but torch
(2.10+) needs the GIL whenever C++ drops the last reference it holds to a tensor that has a
Python object (TensorImpl::decref_pyobject). The graph's inputs are such tensors, so each
input's last use inside the graph would wait for the GIL, and with the engine loop's thread
running Python that wait is up to a switch interval each time. Here the weights, norms and
cache planes are module attributes, and the caller puts each step's input tensors in `pinned`
before the call: a reference that outlives the graph, so nothing in it drops a last one.
See engine/model/scripted_decode.py for when it runs.
"""

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model.graph_ops import scripted_linear as _linear
from splitserve.engine.model.graph_ops import scripted_moe
from splitserve.engine.model.rope import rotate


class DecodeGraph(nn.Module):
    norms: list[torch.Tensor]  # each layer's input and post-attention norm
    weights: list[torch.Tensor]  # each layer's qkv, o, gate_up and down weight (plain or packed)
    biases: list[torch.Tensor | None]  # each layer's qkv bias
    q_norms: list[torch.Tensor | None]  # each layer's per-head q and k norm (Qwen3)
    k_norms: list[torch.Tensor | None]
    attn_output_norms: list[torch.Tensor | None]  # each layer's norms after attention / the MLP (Gemma 3)
    mlp_output_norms: list[torch.Tensor | None]
    sliding: list[bool]  # each layer rotates by the local tables (Gemma 3's sliding layers)
    windowed: list[bool]  # each layer attends through the window's plan
    moe_routers: list[torch.Tensor | None]  # each layer's router (a mixture-of-experts layer)
    expert_weights: list[list[torch.Tensor]]  # each layer's experts' gate_up and down weights
    embed_scale: torch.Tensor | None
    key_caches: list[torch.Tensor]
    value_caches: list[torch.Tensor]
    pinned: list[torch.Tensor]  # the running step's inputs (module docstring)

    def __init__(self, model, packed: bool, lm_head: torch.Tensor, lm_head_packed: bool):
        super().__init__()
        config = model.config
        layers = model._layer_list
        self.embed = model.embed_tokens.data
        self.cos_table = model.rotary.cos_half
        self.sin_table = model.rotary.sin_half
        local = model.rotary if model.local_rotary is None else model.local_rotary
        self.local_cos_table = local.cos_half
        self.local_sin_table = local.sin_half
        self.sliding = [bool(layer.sliding) for layer in layers]
        # Sliding-window layers read the last `window` tokens (0: no layer is windowed).
        self.windowed = [layer.window is not None for layer in layers]
        self.window = int(config.sliding_window or 0) if any(self.windowed) else 0
        self.has_full_layers = not all(self.windowed)
        self.embed_scale = model.embed_scale
        arch = config.registered
        self.norm_plus_one = bool(arch.norm_plus_one)
        self.gelu = arch.activation == "gelu_pytorch_tanh"
        self.softcap = float(config.final_logit_softcapping or 0.0)
        self.attn_output_norms = [None if n.attn_output_norm is None else n.attn_output_norm.data for n in layers]
        self.mlp_output_norms = [None if n.mlp_output_norm is None else n.mlp_output_norm.data for n in layers]
        self.final_norm = model.final_norm.data
        self.lm_head = lm_head
        self.norms = [n.data for layer in layers for n in (layer.input_norm, layer.post_attention_norm)]

        def matmul(weight) -> torch.Tensor:
            return weight.packed if packed else weight.data

        # A mixture-of-experts layer's dense MLP slots hold empty tensors; its router and its
        # experts' weights (gate_up, down, expert by expert) are its own lists.
        none = torch.empty(0)
        self.weights = [
            matmul(getattr(layer, name)) if hasattr(layer, name) else none
            for layer in layers
            for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        ]
        self.moe_routers = [None if layer.moe is None else layer.moe.router_weight.data for layer in layers]
        self.expert_weights = [
            [] if layer.moe is None else [matmul(getattr(e, n)) for e in layer.moe.experts for n in e.MATMUL_WEIGHTS]
            for layer in layers
        ]
        self.top_k = int(config.num_experts_per_tok)
        self.renormalise = bool(config.norm_topk_prob)
        self.moe_in_model_dtype = bool(arch.moe_weights_in_model_dtype)
        self.moe_inter = int(config.moe_intermediate_size)
        self.biases = [None if layer.qkv_bias is None else layer.qkv_bias.data for layer in layers]
        self.q_norms = [None if layer.q_norm is None else layer.q_norm.data for layer in layers]
        self.k_norms = [None if layer.k_norm is None else layer.k_norm.data for layer in layers]
        self.key_caches = []
        self.value_caches = []
        self.pinned = []
        self.packed = packed
        self.lm_head_packed = lm_head_packed
        self.eps = float(config.rms_norm_eps)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(config.head_dim)
        self.intermediate_size = int(config.intermediate_size)
        self.scale = float(layers[0].scale)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # layers.py's rms_norm (float32) or rms_norm_plus_one.
        if self.norm_plus_one:
            return (torch.rms_norm(x.float(), [x.shape[-1]], None, eps) * (1.0 + weight.float())).to(x.dtype)
        return torch.rms_norm(x, [x.shape[-1]], weight, eps)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = F.embedding(input_ids, self.embed)
        embed_scale = self.embed_scale
        if embed_scale is not None:
            hidden = hidden * embed_scale
        return hidden

    def _qkv(
        self, i: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's attention input for every row of hidden: q and k normed (where the model
        norms them) and rotated, and v; each [rows, heads, head_dim]."""
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size, eps = num_heads * head_dim, num_kv_heads * head_dim, self.eps
        num_tokens = hidden.shape[0]
        x = self._norm(hidden, self.norms[2 * i], eps)
        qkv = _linear(x, self.weights[4 * i], self.packed, self.biases[i])
        qk = qkv[:, : q_size + kv_size].view(num_tokens, num_heads + num_kv_heads, head_dim)
        q_norm, k_norm = self.q_norms[i], self.k_norms[i]
        if q_norm is not None and k_norm is not None:
            q_normed = self._norm(qk[:, :num_heads], q_norm, eps)
            qk = torch.cat((q_normed, self._norm(qk[:, num_heads:], k_norm, eps)), 1)
        qk = rotate(qk, cos, sin)
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        return qk[:, :num_heads], qk[:, num_heads:], v

    def _layer_tail(self, i: int, attn: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Layer i after attention: o_proj, the residual, then the MLP (or MoE) and its residual."""
        eps, packed, inter = self.eps, self.packed, self.intermediate_size
        out = _linear(attn, self.weights[4 * i + 1], packed, None)
        attn_output_norm = self.attn_output_norms[i]
        if attn_output_norm is not None:
            out = self._norm(out, attn_output_norm, eps)
        hidden = out.add_(hidden)
        x = self._norm(hidden, self.norms[2 * i + 1], eps)
        router = self.moe_routers[i]
        if router is not None:
            out = scripted_moe(
                x,
                router,
                self.expert_weights[i],
                packed,
                self.moe_inter,
                self.top_k,
                self.renormalise,
                self.moe_in_model_dtype,
                self.gelu,
            )
        else:
            gate_up = _linear(x, self.weights[4 * i + 2], packed, None)
            if self.gelu:
                act = F.gelu(gate_up[:, :inter], approximate="tanh").mul_(gate_up[:, inter:])
            else:
                act = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
            out = _linear(act, self.weights[4 * i + 3], packed, None)
        mlp_output_norm = self.mlp_output_norms[i]
        if mlp_output_norm is not None:
            out = self._norm(out, mlp_output_norm, eps)
        return out.add_(hidden)

    def _plan(
        self, block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """SparseDecodePlan (engine/ops/sparse_decode.py) for the layers of one window (0: the
        whole context): each query head's cache rows, their padding, the CSR row offsets, and
        the pattern's zero values."""
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        block_size = self.key_caches[0].shape[1]
        device = block_tables.device
        batch = block_tables.shape[0]
        context = context_lens.long()
        length = max_context_len
        first = torch.zeros_like(context)
        if window > 0:  # visible_positions
            length = min(length, window)
            first = (context - window).clamp_(min=0)
        positions = first[:, None] + torch.arange(length, device=device)
        padding = positions >= context[:, None]
        positions = positions.masked_fill_(padding, 0)
        slots = block_tables.gather(1, torch.div(positions, block_size, rounding_mode="floor")).long() * block_size
        slots = (slots + positions % block_size).masked_fill_(padding, 0)
        kv_head_of = torch.div(torch.arange(num_heads, device=device), num_heads // num_kv_heads, rounding_mode="floor")
        rows = (slots[:, None, :] * num_kv_heads + kv_head_of[None, :, None]).reshape(batch * num_heads, length)
        padding = padding[:, None, :].expand(batch, num_heads, length).reshape(batch * num_heads, length)
        num_entries = batch * num_heads * length
        crow = torch.arange(0, num_entries + 1, length, device=device)
        zeros = torch.zeros(num_entries, dtype=self.embed.dtype, device=device)
        return rows, padding, crow, zeros

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
    ) -> torch.Tensor:
        """LlamaForCausalLM.forward for one decode token per sequence: final hidden states."""
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        eps = self.eps
        hidden = self._embed(input_ids)
        cos = self.cos_table.index_select(0, positions)
        sin = self.sin_table.index_select(0, positions)
        local_cos = self.local_cos_table.index_select(0, positions)
        local_sin = self.local_sin_table.index_select(0, positions)
        # SparseDecodePlan: the cache rows each query head reads, shared by every layer of a
        # window (the windowed layers' plan; the full layers' where some layer sees it all).
        local_plan = self._plan(block_tables, context_lens, max_context_len, self.window)
        full_plan = local_plan
        if self.window > 0 and self.has_full_layers:
            full_plan = self._plan(block_tables, context_lens, max_context_len, 0)
        num_blocks_total, block_size = self.key_caches[0].shape[0], self.key_caches[0].shape[1]
        num_rows = num_blocks_total * block_size * num_kv_heads

        q_size = num_heads * head_dim
        num_tokens = hidden.shape[0]
        flat = [num_blocks_total * block_size, num_kv_heads, head_dim]
        for i in range(len(self.key_caches)):
            key_cache, value_cache = self.key_caches[i], self.value_caches[i]
            if self.sliding[i]:
                q, k, v = self._qkv(i, hidden, local_cos, local_sin)
            else:
                q, k, v = self._qkv(i, hidden, cos, sin)
            key_cache.view(flat).index_copy_(0, slot_mapping, k)  # write_kv
            value_cache.view(flat).index_copy_(0, slot_mapping, v)
            rows, padding, crow, zeros = local_plan if self.windowed[i] else full_plan
            cols = rows.view(-1)
            # SparseDecodePlan.attend; torch.sparse_csr_tensor(check_invariants=False) is this op.
            pattern = torch.ops.aten._sparse_csr_tensor_unsafe(
                crow, cols, zeros, [rows.shape[0], num_rows], dtype=hidden.dtype
            )
            keys = key_cache.view(num_rows, head_dim).t()
            scores = torch.ops.aten.sparse_sampled_addmm(
                pattern, q.reshape(-1, head_dim), keys, beta=0.0, alpha=self.scale
            )
            probs = scores.values().view(rows.shape).masked_fill_(padding, float("-inf")).softmax(-1)
            values = value_cache.view(num_rows, head_dim)
            bag_offsets = crow[:-1]  # F.embedding_bag's, for 2-D input
            attn = torch.embedding_bag(values, cols, bag_offsets, False, 0, False, probs.reshape(-1), False, None)[0]
            hidden = self._layer_tail(i, attn.reshape(num_tokens, q_size), hidden)
        return self._norm(hidden, self.final_norm, eps)

    @torch.jit.export
    def greedy_step(
        self,
        fill_rows: torch.Tensor,
        fill_ids: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        max_context_len: int,
    ) -> torch.Tensor:
        """A whole all-greedy decode step: the placeholder fill (fill_ids into rows fill_rows),
        the forward, compute_logits and the sampler's argmax; each row's token."""
        if fill_rows.numel() > 0:
            input_ids.index_copy_(0, fill_rows, fill_ids)
        hidden = self.forward(input_ids, positions, slot_mapping, block_tables, context_lens, max_context_len)
        logits = _linear(hidden, self.lm_head, self.lm_head_packed, None).float()
        if self.softcap > 0.0:  # LlamaForCausalLM.compute_logits (tanh keeps the argmax, but not its ties)
            logits = torch.tanh(logits / self.softcap).mul_(self.softcap)
        return logits.max(dim=-1).indices
