"""gpu_check check 14: the MoE experts (engine/model/moe.py) on the device, and what to run them as.

Issue #37 asks that experts on CUDA run as a grouped computation picked by measurement. Per shape
(Mixtral-like: hidden 4096, 8 experts of width 14336, top 2; Qwen3-30B-A3B-like: hidden 2048,
128 experts of width 768, top 8, weights applied in the model dtype), dtype (bf16, fp16) and step
(1, 32, 256 tokens), three ways to compute the same layer, each checked against a float64
reference (every token through its top-k experts, weighted, from the same routing) relative to
the reference output's largest value, then timed:
- `engine`: SparseMoeMlp itself: one matmul pair per expert over its gathered tokens (the expert
  counts go to the host, a sync per layer), or, on CUDA from STACKED_MIN_EXPERTS experts, its
  own stacked bmm (`forward_stacked`, chosen from this check's first H200 run);
- `bmm`: every expert over a padded [experts, most tokens of one expert, hidden] batch, two bmm;
- `grouped`: torch._grouped_mm over the gathered rows with per-expert offsets (no host sync),
  where this torch on this device has it (else skipped, the reason recorded).
Each item reports the ms of each and the fastest, so the device run can pick the CUDA path.
All three route alike (the engine's `route`), so the timing compares the experts' computation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from splitserve.bench.gpu_check.gpu_check_ops import item, time_ms
from splitserve.engine.model.moe import SparseMoeMlp, route
from splitserve.engine.model_config import ModelConfig

# Relative to the reference output's largest value: the 16-bit paths round the projections,
# the activation and (Qwen3-MoE) the routing weights to the model dtype.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _shapes(tiny: bool) -> dict[str, ModelConfig]:
    """name -> the MoE fields of a ModelConfig (attention fields are not used by the MLP)."""

    def moe(arch: str, hidden: int, experts: int, inter: int, top_k: int) -> ModelConfig:
        return ModelConfig(
            arch,
            128,
            hidden,
            inter,
            1,
            4,
            4,
            16,
            128,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=inter,
            norm_topk_prob=arch == "MixtralForCausalLM",
        )

    if tiny:
        return {
            "mixtral-like": moe("MixtralForCausalLM", 64, 4, 96, 2),
            "qwen3-moe-like": moe("Qwen3MoeForCausalLM", 64, 16, 32, 4),
        }
    return {
        "mixtral-like": moe("MixtralForCausalLM", 4096, 8, 14336, 2),
        "qwen3-moe-like": moe("Qwen3MoeForCausalLM", 2048, 128, 768, 8),
    }


def _layer(config: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int) -> SparseMoeMlp:
    """A SparseMoeMlp with random weights scaled so every projection's output is about N(0, 1)."""
    mlp = SparseMoeMlp(config, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    with torch.no_grad():
        mlp.router_weight.copy_(torch.randn(mlp.router_weight.shape, generator=gen, device=device) / hidden**0.5)
        for expert in mlp.experts:
            gate_up = torch.randn(2 * inter, hidden, generator=gen, device=device) / hidden**0.5
            expert.gate_up_weight.copy_(gate_up)
            expert.down_weight.copy_(torch.randn(hidden, inter, generator=gen, device=device) / inter**0.5)
    return mlp


def _routing(mlp: SparseMoeMlp, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and experts SparseMoeMlp.forward computes (the same calls)."""
    weights, experts = route(F.linear(x, mlp.router_weight), mlp.top_k, mlp.renormalise)
    if mlp.weights_in_model_dtype:
        weights = weights.to(x.dtype)
    return weights, experts


def _reference(mlp: SparseMoeMlp, x: torch.Tensor) -> torch.Tensor:
    """float64: every token through each of its top-k experts (the engine's routing), weighted, summed."""
    weights, experts = _routing(mlp, x)
    x64 = x.double()
    combine = torch.zeros(x.shape[0], mlp.num_experts, dtype=torch.float64, device=x.device)
    combine.scatter_add_(1, experts, weights.double())
    out = torch.zeros_like(x64)
    for e, expert in enumerate(mlp.experts):
        rows = combine[:, e].nonzero().flatten()
        if rows.numel():
            projected = x64[rows] @ expert.gate_up_weight.double().t()
            act = F.silu(projected[:, : mlp.inter]) * projected[:, mlp.inter :]
            out.index_add_(0, rows, (act @ expert.down_weight.double().t()) * combine[rows, e : e + 1])
    return out


class _Stacked:
    """The experts' weights stacked, [experts, in, out] views of [experts, out, in] storage: the
    layout both bmm and torch._grouped_mm (which wants its second operand transposed) take."""

    def __init__(self, mlp: SparseMoeMlp):
        self.gate_up = torch.stack([e.gate_up_weight for e in mlp.experts]).transpose(1, 2)
        self.down = torch.stack([e.down_weight for e in mlp.experts]).transpose(1, 2)


def _grouped_rows(mlp: SparseMoeMlp, x: torch.Tensor):
    """The engine's grouping: weights, choices ordered by expert (tokens in order), their tokens,
    the per-expert counts (on the device)."""
    weights, experts = _routing(mlp, x)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = torch.div(order, mlp.top_k, rounding_mode="floor")
    counts = torch.bincount(flat, minlength=mlp.num_experts)
    return weights.reshape(-1).index_select(0, order), flat.index_select(0, order), tokens, counts


def _scatter(x: torch.Tensor, tokens: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x).index_add_(0, tokens, (out * weights[:, None]).to(x.dtype))


def _bmm(mlp: SparseMoeMlp, stacked: _Stacked, x: torch.Tensor) -> torch.Tensor:
    """Every expert over a padded batch of the most rows any expert got."""
    weights, sorted_experts, tokens, counts = _grouped_rows(mlp, x)
    most = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(tokens.numel(), device=x.device) - starts.index_select(0, sorted_experts)
    slots = sorted_experts * most + rank
    padded = x.new_zeros(mlp.num_experts * most, mlp.hidden).index_copy_(0, slots, x.index_select(0, tokens))
    projected = torch.bmm(padded.view(mlp.num_experts, most, mlp.hidden), stacked.gate_up)
    act = F.silu(projected[..., : mlp.inter]) * projected[..., mlp.inter :]
    out = torch.bmm(act, stacked.down).view(-1, mlp.hidden).index_select(0, slots)
    return _scatter(x, tokens, out, weights)


def _grouped_mm(mlp: SparseMoeMlp, stacked: _Stacked, x: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm over the gathered rows: group g is rows offs[g-1]:offs[g]."""
    weights, _, tokens, counts = _grouped_rows(mlp, x)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    projected = torch._grouped_mm(x.index_select(0, tokens), stacked.gate_up, offs=offs)
    act = F.silu(projected[:, : mlp.inter]) * projected[:, mlp.inter :]
    return _scatter(x, tokens, torch._grouped_mm(act, stacked.down, offs=offs), weights)


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def _measure(
    methods: dict[str, Callable[[], torch.Tensor]], want: torch.Tensor, device: torch.device, reps: dict
) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """Each method's relative error and ms; a method that raises is skipped with its reason."""
    errors, ms, skipped = {}, {}, {}
    for name, fn in methods.items():
        try:
            errors[name] = _error(fn(), want)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            continue
        ms[name] = time_ms(fn, device, **reps)
    return errors, ms, skipped


def check_moe(device: torch.device, tiny: bool) -> dict:
    items = []
    grouped_op = hasattr(torch, "_grouped_mm")
    if not grouped_op:
        items.append(item("torch._grouped_mm", "info", f"absent in torch {torch.__version__}: skipped"))
    batches = (1, 5, 17) if tiny else (1, 32, 256)
    reps = dict(reps=2, warmup=1) if tiny else dict(reps=20, warmup=3)
    for index, (shape, config) in enumerate(_shapes(tiny).items()):
        for dtype in (torch.bfloat16, torch.float16):
            mlp = _layer(config, dtype, device, seed=index)
            stacked = _Stacked(mlp)
            gen = torch.Generator(device=device).manual_seed(100 + index)
            for batch in batches:
                x = torch.randn(batch, config.hidden_size, generator=gen, device=device).to(dtype)
                with torch.inference_mode():
                    want = _reference(mlp, x)
                    methods = {
                        "engine": lambda m=mlp, x=x: m(x, F.silu),
                        "bmm": lambda m=mlp, s=stacked, x=x: _bmm(m, s, x),
                    }
                    if grouped_op:
                        methods["grouped"] = lambda m=mlp, s=stacked, x=x: _grouped_mm(m, s, x)
                    errors, ms, skipped = _measure(methods, want, device, reps)
                ok = "engine" in errors and all(e <= TOLERANCE[dtype] for e in errors.values())
                fastest = min(ms, key=ms.__getitem__) if ms else "none"
                notes = [f"vs float64 reference <= {TOLERANCE[dtype]} of its largest value; fastest: {fastest}"]
                notes += [f"{name} skipped ({reason})" for name, reason in skipped.items()]
                numbers = {f"err_{name}": e for name, e in errors.items()}
                numbers.update({f"{name}_ms": t for name, t in ms.items()}, fastest=fastest)
                items.append(
                    item(
                        f"{shape} {str(dtype)[6:]} tokens {batch}",
                        "pass" if ok else "fail",
                        "; ".join(notes),
                        **numbers,
                    )
                )
            del mlp, stacked
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"items": items}
