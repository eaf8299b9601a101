"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts and only those experts compute it, each over the tokens routed to it, gathered into one
matmul per expert; the weighted outputs are summed back per token. Never every expert on every
token. Each expert's weights are their own (plain, oneDNN-packed or quantized) weights.

Per-expert torch matmuls rather than torch._grouped_mm: on CPU (torch 2.13) the private grouped
op gives the same result on a small case (4 experts, hidden 64, 64 tokens, top-2) but is no
faster there, and it is a private API."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.model_config import ModelConfig
from splitserve.engine.quant.quantize import linear


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
        weights, experts = route(F.linear(x, self.router_weight), self.top_k, self.renormalise)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
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
