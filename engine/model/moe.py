"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts and only those experts compute it, each over the tokens routed to it, gathered into one
matmul per expert; the weighted outputs are summed back per token. Never every expert on every
token. Each expert's weights are their own (plain, oneDNN-packed or quantized) weights.

Per-expert torch matmuls rather than torch._grouped_mm: on CPU (torch 2.13) the private grouped
op gives the same result on a small case (4 experts, hidden 64, 64 tokens, top-2) but is no
faster there, and it is a private API.

On CUDA a layer of many experts runs them as two padded bmm over stacked weights instead
(`forward_stacked`). bench/gpu_check/gpu_check.py check 14 on an H200 (torch 2.11, bf16) measured
the per-expert loop 10x slower than bmm with 128 experts (Qwen3-30B-A3B-like, 32 and 256 tokens:
11.5 / 12.0 ms against 1.2 / 1.1 ms; it launches a few kernels per active expert), while with 8
(Mixtral-like) the loop was as fast or faster (1 token: 0.73 against 1.36 ms; 256: 1.39 against
1.69). torch._grouped_mm was no faster than bmm in bf16 and up to 5x slower in fp16 there."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model_config import ModelConfig
from splitserve.engine.quant.quantize import linear

STACKED_MIN_EXPERTS = 16  # between check 14's 8 (the loop wins) and 128 (bmm wins 10x)


def route(router_logits: torch.Tensor, top_k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, experts] -> (float32 weights [T, top_k], expert ids [T, top_k]), as
    transformers routes: softmax in float32, torch.topk (so ties break as torch.topk breaks them,
    not necessarily the lower expert id first), then, where the model says so, the k weights rescaled to
    sum to one."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


class Expert(nn.Module):
    """One expert's matmul weights: gate_up_weight [2I, hidden] (its gate rows, then its up
    rows) and down_weight [hidden, I]. Named as DecoderLayer's dense MLP weights, so the load-time
    quantizer and the CPU packing treat them alike (each becomes a quantized or packed weight)."""

    MATMUL_WEIGHTS = ("gate_up_weight", "down_weight")

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, device):
        super().__init__()
        self.gate_up_weight = nn.Parameter(
            torch.empty(2 * inter, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.down_weight = nn.Parameter(torch.empty(hidden, inter, dtype=dtype, device=device), requires_grad=False)


class SparseMoeMlp(nn.Module):
    """Router + experts of one decoder layer. The router stays in full precision (routing must
    pick transformers' experts); each expert's weights may be quantized (engine/quant) or packed
    for oneDNN as they load, like a dense MLP's. Under tensor parallelism config is one rank's:
    each expert holds its share of the intermediate dimension (engine/parallel/shard_plan.py),
    the router all of it, and the caller sums the ranks' partial outputs."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device, linear_device=None):
        """linear_device: where the experts' weights live until loaded ("meta" when the loader
        quantizes them, as DecoderLayer's)."""
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.weights_in_model_dtype = config.registered.moe_weights_in_model_dtype
        self.hidden = config.hidden_size
        self.inter = config.moe_intermediate_size
        lin = device if linear_device is None else linear_device
        self.router_weight = nn.Parameter(
            torch.empty(self.num_experts, self.hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.experts = nn.ModuleList(Expert(self.hidden, self.inter, dtype, lin) for _ in range(self.num_experts))
        self._expert_list = list(self.experts)  # plain list: cheaper to index in the hot loop
        # [experts, in, out] views of the experts' weights, stacked on the first CUDA forward.
        self._stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    def weight_slices(self, names: tuple[str, str, str, str]) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF sub-name -> (tensor, first row, row count). names: the checkpoint's MoE block, and
        its experts' gate, up and down projections (the registry's moe_weight_names)."""
        block, gate, up, down = names
        inter, hidden = self.inter, self.hidden
        slices = {f"{block}.gate.weight": (self.router_weight, 0, self.num_experts)}
        for e, weights in enumerate(self._expert_list):
            expert = f"{block}.experts.{e}"
            slices[f"{expert}.{gate}.weight"] = (weights.gate_up_weight, 0, inter)
            slices[f"{expert}.{up}.weight"] = (weights.gate_up_weight, inter, inter)
            slices[f"{expert}.{down}.weight"] = (weights.down_weight, 0, hidden)
        return slices

    def forward(self, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]: sum over each token's k experts of
        weight * down(act(gate(x)) * up(x)). The choices are grouped by expert (increasing id,
        tokens in order) and gathered once; each expert multiplies its run of rows; the outputs
        are weighted and scattered back in one index_add_, in that order, which is the order in
        which transformers accumulates each token's sum. Per expert only its matmuls and
        activation run: on CPU a step is bound by how many ops it dispatches
        (bench/results/architectures.md)."""
        if x.is_cuda and self.num_experts >= STACKED_MIN_EXPERTS and self._plain_weights():
            return self.forward_stacked(x, activation)
        weights, experts = self._route(x)
        flat = experts.reshape(-1)  # [T * k]: token t's j-th choice at t * k + j
        order = torch.argsort(flat, stable=True)  # the choices grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = torch.div(order, self.top_k, rounding_mode="floor")
        routed = x.index_select(0, tokens)  # every expert's tokens, one run after another
        inter = self.inter
        outputs = []
        start = 0
        for expert, count in zip(self._expert_list, counts):
            if count:
                projected = linear(routed[start : start + count], expert.gate_up_weight)
                act = activation(projected[:, :inter]).mul_(projected[:, inter:])
                outputs.append(linear(act, expert.down_weight))
                start += count
        weighted = torch.cat(outputs) * weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = route(F.linear(x, self.router_weight), self.top_k, self.renormalise)
        return (weights.to(x.dtype) if self.weights_in_model_dtype else weights), experts

    def _plain_weights(self) -> bool:
        """Stackable: every expert's weights are plain tensors (not quantized or packed)."""
        return self._stacked is not None or all(
            isinstance(getattr(e, name), torch.Tensor) for e in self._expert_list for name in Expert.MATMUL_WEIGHTS
        )

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [experts, hidden, 2I], down [experts, I, hidden]): the experts' weights moved
        into one tensor each, every expert's parameters becoming views of it (no second copy)."""
        if self._stacked is None:
            with torch.inference_mode(False):  # the parameters are normal tensors: so is their storage
                gate_up = torch.stack([e.gate_up_weight.detach() for e in self._expert_list])
                down = torch.stack([e.down_weight.detach() for e in self._expert_list])
                for index, expert in enumerate(self._expert_list):
                    expert.gate_up_weight.data = gate_up[index]
                    expert.down_weight.data = down[index]
            self._stacked = (gate_up.transpose(1, 2), down.transpose(1, 2))
        return self._stacked

    def forward_stacked(self, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """forward as two bmm over every expert, each on a zero-padded batch of the most tokens
        any expert got; the same grouping, weighting and scatter order as forward."""
        gate_up, down = self.stacked_weights()
        weights, experts = self._route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sorted_experts = flat.index_select(0, order)
        tokens = torch.div(order, self.top_k, rounding_mode="floor")
        counts = torch.bincount(flat, minlength=self.num_experts)
        most = int(counts.max())  # the one host sync (the loop syncs on every count)
        rank = torch.arange(tokens.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
        slots = sorted_experts * most + rank  # each choice's row in the padded batch
        padded = x.new_zeros(self.num_experts * most, self.hidden).index_copy_(0, slots, x.index_select(0, tokens))
        projected = torch.bmm(padded.view(self.num_experts, most, self.hidden), gate_up)
        act = activation(projected[..., : self.inter]).mul_(projected[..., self.inter :])
        out = torch.bmm(act, down).view(-1, self.hidden).index_select(0, slots)
        weighted = out * weights.reshape(-1).index_select(0, order)[:, None]
        return torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))
