"""ModelConfig: the subset of a checkpoint's config.json the decoders need, validated as it
loads; each architecture's own fields come from its registry entry (engine/model/architectures.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from splitserve.engine.config import DTYPES, ConfigError
from splitserve.engine.model.architectures import (
    ARCHITECTURES,
    FULL,
    SLIDING,
    Architecture,
    gemma3_fields,
    moe_fields,
    unsupported_feature,
    window_fields,
)

LAYER_KINDS = {SLIDING, FULL}  # config.json's layer_types


@dataclass
class ModelConfig:
    """The subset of a Hugging Face config.json that a Llama-family decoder needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Sliding-window attention (engine/model/architectures.py, window_fields): a windowed
    # layer's query sees itself and the sliding_window - 1 tokens before it (transformers'
    # mask); which layers are windowed is layer_types. None: every layer sees everything.
    sliding_window: int | None = None
    # A pre-quantized checkpoint's config.json quantization_config (engine/quant/checkpoint_scheme.py).
    quantization_config: dict[str, Any] | None = None
    # Each layer's kind, sliding or full attention (set where some layer is windowed). Gemma 3
    # (gemma3_fields): also the sliding layers' own rope base, the attention scale's
    # denominator (query_pre_attn_scalar ** -0.5) and tanh soft-capping of the final logits.
    layer_types: list[str] | None = None
    local_rope_theta: float | None = None
    local_rope_type: str = "default"
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (engine/model/architectures.py, moe_fields; engine/model/moe.py):
    # 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: list[int] | None = None  # the layers whose MLP is the experts

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
            )
        from splitserve.engine.quant.checkpoint_scheme import UnsupportedQuantization

        try:
            self.checkpoint_scheme  # noqa: B018  (a checkpoint we cannot run fails here, in the preflight too)
        except UnsupportedQuantization as exc:
            raise ConfigError(str(exc)) from None
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "default", "linear", None):
                raise ConfigError(f"unsupported rope_scaling type {kind!r}")
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= LAYER_KINDS
        ):
            raise ConfigError(
                f"layer_types must name {self.num_hidden_layers} layers, each one of {sorted(LAYER_KINDS)}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok must be in 1..{self.num_experts} (the experts), got {self.num_experts_per_tok}"
            )
        if self.local_rope_type != "default":
            raise ConfigError(f"unsupported rope type {self.local_rope_type!r} for the sliding-window layers")

    @property
    def max_context_len(self) -> int:
        """The longest context the model serves (its positions; a sliding window is computed, not a cap)."""
        return self.max_position_embeddings

    def layer_window(self, layer: int) -> int | None:
        """The tokens layer `layer`'s queries see (themselves included); None: the whole context."""
        if self.sliding_window and self.layer_types is not None and self.layer_types[layer] == SLIDING:
            return self.sliding_window
        return None

    @property
    def kv_window(self) -> int | None:
        """Where every layer is windowed: the window, past which no layer reads a token's KV
        again (the scheduler frees such blocks, engine/core/kv_cache_manager.py). None where
        some layer sees the whole context (Gemma 3's global layers): every block stays."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return None if None in windows else self.sliding_window

    def resolve_max_model_len(self, requested: int | None) -> int:
        """The context length to serve: `requested`, or the model's own when None. More than
        the model computes exactly is refused, as vLLM refuses it."""
        if requested is None:
            return self.max_context_len
        if requested > self.max_context_len:
            raise ConfigError(
                f"max_model_len {requested} exceeds the model's context of {self.max_context_len} tokens"
                " (max_position_embeddings)"
            )
        return requested

    @property
    def registered(self) -> Architecture:
        """This architecture's registry entry (engine/model/architectures.py)."""
        return ARCHITECTURES[self.architecture]

    @property
    def qk_norm(self) -> bool:
        return self.registered.qk_norm

    @property
    def checkpoint_scheme(self):
        """The pre-quantized checkpoint's CheckpointScheme, or None (full precision)."""
        from splitserve.engine.quant.checkpoint_scheme import checkpoint_scheme

        return checkpoint_scheme(self.quantization_config)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' entry")
        arch = archs[0]
        refused = unsupported_feature(arch, raw) if arch in ARCHITECTURES else None
        if refused is not None:
            raise ConfigError(refused)
        missing = [k for k in ("num_attention_heads", "hidden_size") if k not in raw]
        if missing:
            raise ConfigError(f"config.json is missing required key {missing[0]!r}")
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")
        rope_theta = raw.get("rope_theta")
        rope_scaling = raw.get("rope_scaling")
        # transformers 5 nests rope settings under rope_parameters.
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") not in ("default", None):
                rope_scaling = rope_params
        try:
            fields: dict[str, Any] = dict(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias; the others only when attention_bias is set.
                attention_bias=bool(
                    raw.get("attention_bias", arch in ARCHITECTURES and ARCHITECTURES[arch].attention_bias)
                ),
                dtype=dtype,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
                quantization_config=raw.get("quantization_config"),
            )
            if arch in ARCHITECTURES:
                fields.update(window_fields(ARCHITECTURES[arch], raw))
            if arch == "Gemma3ForCausalLM":
                fields.update(gemma3_fields(raw))
            if arch in ARCHITECTURES and ARCHITECTURES[arch].moe_weight_names is not None:
                fields.update(moe_fields(raw))
        except KeyError as exc:
            raise ConfigError(f"config.json is missing required key {exc.args[0]!r}") from None
        return cls(**fields)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)
