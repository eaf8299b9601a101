"""TorchScript functions DecodeGraph (engine/model/decode_graph.py) calls, op for op the eager
model's: a matmul (quant/quantize.py's linear over a plain or oneDNN-packed weight) and the
mixture-of-experts MLP (engine/model/moe.py's SparseMoeMlp.forward)."""

import torch
import torch.nn.functional as F


def scripted_linear(x: torch.Tensor, weight: torch.Tensor, packed: bool, bias: torch.Tensor | None) -> torch.Tensor:
    # engine/quant/quantize.py's linear: a packed weight multiplies, then the bias is added.
    if packed:
        no_scalars: list[int | float | complex | None] = []
        out = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", no_scalars, "")
    else:
        out = F.linear(x, weight, None)
    if bias is not None:
        out = out.add_(bias)
    return out


def scripted_moe(
    x: torch.Tensor,
    router: torch.Tensor,
    experts: list[torch.Tensor],
    packed: bool,
    inter: int,
    top_k: int,
    renormalise: bool,
    weights_in_model_dtype: bool,
    gelu: bool,
) -> torch.Tensor:
    """SparseMoeMlp.forward (with moe.route); experts: each expert's gate_up then down weight
    (inter wide), side by side."""
    probs = torch.softmax(F.linear(x, router).float(), dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_in_model_dtype:
        weights = weights.to(x.dtype)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts: list[int] = torch.bincount(flat, minlength=len(experts) // 2).tolist()
    tokens = torch.div(order, top_k, rounding_mode="floor")
    routed = x.index_select(0, tokens)
    outputs: list[torch.Tensor] = []
    start = 0
    for e in range(len(counts)):
        count = counts[e]
        if count > 0:
            projected = scripted_linear(routed[start : start + count], experts[2 * e], packed, None)
            if gelu:
                act = F.gelu(projected[:, :inter], approximate="tanh").mul_(projected[:, inter:])
            else:
                act = F.silu(projected[:, :inter]).mul_(projected[:, inter:])
            outputs.append(scripted_linear(act, experts[2 * e + 1], packed, None))
            start += count
    weighted = torch.cat(outputs) * weights.reshape(-1).index_select(0, order)[:, None]
    return torch.zeros_like(x).index_add_(0, tokens, weighted.to(x.dtype))
