"""PrefillGraph: DecodeGraph (engine/model/decode_graph.py) plus the prefill of one fresh
prompt, as one TorchScript method that runs without the GIL.

Why: a prompt's forward is the first token's largest share at low load (bench/results/
vs_vllm_bench.md). Eager, it is ~15 torch calls per layer, each taking the GIL back from
whatever the replica's other threads run meanwhile (its actor's event loop hands the request
in and streams the tokens out); scripted, the whole forward holds no GIL. Op for op it is what
LlamaForCausalLM.forward runs for such a step (engine/model/layers.py, ops/attention.py's
write_kv and uniform_prefill_attention, and for the row read out the last layer's decode query
through paged_decode_attention_torch's one-sequence path), so the same bits.

What it covers (prefill_graph_applies): one sequence whose new tokens are its whole context
(no cached prefix), on a model without sliding-window layers, with either no row read out (a
chunk of a longer prompt) or only the last one. The caller pins the inputs (DecodeGraph's
docstring: why).
"""

import torch
import torch.nn.functional as F

from splitserve.engine.model.decode_graph import DecodeGraph


def prefill_graph_applies(meta, kv_cache, output_rows: list[int] | None) -> bool:
    """One fresh prompt (no cached prefix) on an unquantized float32 CPU cache, reading out no
    row or only its last one."""
    num_tokens = meta.query_start_loc_cpu[-1]
    return (
        meta.num_seqs == 1
        and meta.max_query_len > 1
        and meta.context_lens_cpu[0] == num_tokens
        and (not output_rows or list(output_rows) == [num_tokens - 1])
        and not kv_cache.quantized
        and kv_cache.dtype == torch.float32
        and kv_cache.device.type == "cpu"
    )


class PrefillGraph(DecodeGraph):
    @torch.jit.export
    def prefill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        read_out_last: bool,
    ) -> torch.Tensor:
        """LlamaForCausalLM.forward(output_rows=[T - 1] if read_out_last else []) for one fresh
        prompt of T tokens: the final hidden state of its last row [1, hidden], or [0, hidden]."""
        num_heads, num_kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        eps = self.eps
        hidden = self._embed(input_ids)
        cos = self.cos_table.index_select(0, positions)
        sin = self.sin_table.index_select(0, positions)
        num_blocks_total, block_size = self.key_caches[0].shape[0], self.key_caches[0].shape[1]
        q_size = num_heads * head_dim
        num_tokens = hidden.shape[0]
        flat = [num_blocks_total * block_size, num_kv_heads, head_dim]
        shape = [1, num_tokens, -1, head_dim]
        gqa = num_heads != num_kv_heads
        last = len(self.key_caches) - 1
        for i in range(len(self.key_caches)):
            key_cache, value_cache = self.key_caches[i], self.value_caches[i]
            q, k, v = self._qkv(i, hidden, cos, sin)
            key_cache.view(flat).index_copy_(0, slot_mapping, k)  # write_kv
            value_cache.view(flat).index_copy_(0, slot_mapping, v)
            if i == last:
                if not read_out_last:  # layers.py: a chunk that samples nothing
                    return self._norm(hidden[:0], self.final_norm, eps)
                # OutputRows: the last row alone, a decode query over the whole context
                # (paged_decode_attention_torch, one sequence: its blocks gathered, no mask).
                row = torch.arange(num_tokens - 1, num_tokens, device=hidden.device)
                q, hidden = q.index_select(0, row), hidden.index_select(0, row)
                num_blocks = (num_tokens + block_size - 1) // block_size
                ids = block_tables[:, :num_blocks].reshape(-1)
                context = [1, num_blocks * block_size, num_kv_heads, head_dim]
                keys = key_cache.index_select(0, ids).view(context)[:, 0:num_tokens]
                values = value_cache.index_select(0, ids).view(context)[:, 0:num_tokens]
                q4 = q.view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
                attended = F.scaled_dot_product_attention(
                    q4, keys.transpose(1, 2), values.transpose(1, 2), scale=self.scale
                )
                attn = attended.reshape(1, num_heads, head_dim).reshape(1, q_size)
            else:
                # paged_attention's fresh run (uniform_prefill_attention), into a fresh output.
                out = torch.empty_like(q)
                attended = F.scaled_dot_product_attention(
                    q[0:num_tokens].view(shape).transpose(1, 2),
                    k[0:num_tokens].view(shape).transpose(1, 2),
                    v[0:num_tokens].view(shape).transpose(1, 2),
                    is_causal=True,
                    scale=self.scale,
                    enable_gqa=gqa,
                )
                out[0:num_tokens] = attended.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)
                attn = out.reshape(num_tokens, q_size)
            hidden = self._layer_tail(i, attn, hidden)
        return self._norm(hidden, self.final_norm, eps)
