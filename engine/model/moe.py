"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts and only those experts compute it, each over the tokens routed to it, gathered into one
matmul per expert; the weighted outputs are summed back per token. Never every expert on every
token.

Per-expert torch matmuls rather than torch._grouped_mm: on CPU (torch 2.13) the private grouped
op gives the same result on a small case (4 experts, hidden 64, 64 tokens, top-2) but is no
faster there, and it is a private API."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.config import ModelConfig


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


class SparseMoeMlp(nn.Module):
    """Router + experts of one decoder layer. The experts' weights are stacked row-wise, one
    checkpoint tensor per row range: gate_up_weights [experts * 2I, hidden] (expert e's gate
    rows, then its up rows) and down_weights [experts * hidden, I]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        self.weights_in_model_dtype = config.registered.moe_weights_in_model_dtype
        self.hidden = config.hidden_size
        self.inter = config.moe_intermediate_size
        hidden, inter, experts = self.hidden, self.inter, self.num_experts

        def parameter(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.router_weight = parameter(experts, hidden)
        self.gate_up_weights = parameter(experts * 2 * inter, hidden)
        self.down_weights = parameter(experts * hidden, inter)

    def weight_slices(self, names: tuple[str, str, str, str]) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF sub-name -> (stacked tensor, first row, row count). names: the checkpoint's MoE
        block, and its experts' gate, up and down projections (the registry's moe_weight_names)."""
        block, gate, up, down = names
        inter, hidden = self.inter, self.hidden
        slices = {f"{block}.gate.weight": (self.router_weight, 0, self.num_experts)}
        for e in range(self.num_experts):
            expert = f"{block}.experts.{e}"
            slices[f"{expert}.{gate}.weight"] = (self.gate_up_weights, 2 * inter * e, inter)
            slices[f"{expert}.{up}.weight"] = (self.gate_up_weights, 2 * inter * e + inter, inter)
            slices[f"{expert}.{down}.weight"] = (self.down_weights, hidden * e, hidden)
        return slices

    def forward(self, x: torch.Tensor, activation: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]: sum over each token's k experts of
        weight * down(act(gate(x)) * up(x)). Experts run in increasing id order, so each
        token's sum is accumulated in the order transformers accumulates it."""
        weights, experts = route(F.linear(x, self.router_weight), self.top_k, self.renormalise)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        flat = experts.reshape(-1)  # [T * k]: token t's j-th choice at t * k + j
        order = torch.argsort(flat, stable=True)  # the choices grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        flat_weights = weights.reshape(-1)
        gate_up = self.gate_up_weights.view(self.num_experts, 2 * self.inter, self.hidden)
        down = self.down_weights.view(self.num_experts, self.hidden, self.inter)
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            choices = order[start : start + count]
            start += count
            tokens = choices // self.top_k
            projected = F.linear(x[tokens], gate_up[e])
            act = activation(projected[:, : self.inter]) * projected[:, self.inter :]
            expert_out = F.linear(act, down[e]) * flat_weights[choices, None]
            out.index_add_(0, tokens, expert_out.to(out.dtype))
        return out
