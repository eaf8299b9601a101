"""Llama-family causal LM (Llama, Mistral, Qwen2) running over the paged KV cache."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.config import ModelConfig
from splitserve.engine.model.checkpoint import CheckpointError
from splitserve.engine.model.layers import DecoderLayer, rms_norm
from splitserve.engine.model.rope import RotaryEmbedding
from splitserve.engine.model.scripted_decode import ScriptedDecodeForward, decode_plan_applies
from splitserve.engine.ops.attention import make_decode_plan
from splitserve.engine.ops.attention_metadata import AttentionMetadata
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.ops.onednn_packed_weight import OneDnnPackedWeight
from splitserve.engine.quant.layerwise_quantizer import LayerwiseQuantizer
from splitserve.engine.quant.quantize import linear

_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Buffers some older checkpoints carry; recomputed here, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaForCausalLM(nn.Module):
    """forward() returns final hidden states; compute_logits() turns chosen rows into logits."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quantization: str = "none",
    ):
        """quantization none|int8|fp8|int4: the decoder layers' matmul weights, quantized by
        load_weights as they arrive; embeddings, norms and lm_head stay in dtype."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.quantization = quantization
        linear_device = None if quantization == "none" else "meta"
        hidden = config.hidden_size
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype, device, linear_device) for i in range(config.num_hidden_layers)
        )
        self.final_norm = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device), requires_grad=False)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(
                torch.empty(config.vocab_size, hidden, dtype=dtype, device=device), requires_grad=False
            )
        self.rotary = RotaryEmbedding(config, dtype, device)
        self._layer_list = list(self.layers)  # plain list: cheaper to iterate in the hot loop
        # Set by use_scripted_decode (engine/model/scripted_decode.py) once the weights are final.
        self._scripted_decode: ScriptedDecodeForward | None = None
        self.quantizer = (
            None
            if quantization == "none"
            else LayerwiseQuantizer(self._layer_list, DecoderLayer.LINEAR_WEIGHTS, quantization, dtype, device)
        )

    @property
    def device(self) -> torch.device:  # embeddings are never quantized
        return self.embed_tokens.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids/positions int64 [T] -> final hidden states [T, hidden].

        Every layer writes the new tokens' K/V at meta.slot_mapping before attending;
        on_layer_done(i) runs as soon as layer i's K/V is in the cache, so a KV sender can ship
        layer i while later layers compute.
        """
        if on_layer_done is None and self._scripted_decode is not None and decode_plan_applies(meta, kv_cache):
            # CPU decode: the same ops as below as one TorchScript call, which holds no GIL.
            return self._scripted_decode(input_ids, positions, kv_cache, meta)
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions)
        # Block tables are the same for every layer: index them once per step.
        plan = make_decode_plan(meta, hidden, kv_cache.key_cache(0), self.config.num_attention_heads)
        for i, layer in enumerate(self._layer_list):
            hidden = layer(hidden, cos, sin, kv_cache.key_cache(i), kv_cache.value_cache(i), meta, on_layer_done, plan)
        return rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)

    def use_scripted_decode(self) -> bool:
        """Run CPU pure-decode steps as one TorchScript call (engine/model/scripted_decode.py),
        where this model's weights allow it. Call once the weights are loaded (and packed)."""
        self._scripted_decode = ScriptedDecodeForward.build(self)
        return self._scripted_decode is not None

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]. A normal tensor (no_grad, not inference
        mode) so that samplers may modify it in place."""
        return linear(hidden, self.lm_head).float()

    def pack_matmul_weights(self) -> int:
        """Reorder the full-precision matmul weights for oneDNN (engine/ops/onednn_packed_weight.py),
        once the checkpoint is loaded; quantized weights and a tied lm_head (it is also the
        embedding table, which must stay a plain tensor) are left as they are. Returns how many
        weights were packed."""
        owners = [(layer, name) for layer in self._layer_list for name in DecoderLayer.LINEAR_WEIGHTS]
        if not self.config.tie_word_embeddings:
            owners.append((self, "lm_head"))
        count = 0
        for owner, name in owners:
            packed = OneDnnPackedWeight.pack(getattr(owner, name))
            if packed is not None:
                self._scripted_decode = None  # holds the weights it was built with
                delattr(owner, name)  # a registered Parameter cannot be overwritten by a module
                setattr(owner, name, packed)
                count += 1
        return count

    def _weight_targets(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        targets = {
            "model.embed_tokens.weight": (self.embed_tokens, 0, self.embed_tokens.shape[0]),
            "model.norm.weight": (self.final_norm, 0, self.final_norm.shape[0]),
        }
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, 0, self.lm_head.shape[0])
        for i, layer in enumerate(self._layer_list):
            for sub, target in layer.weight_slices().items():
                targets[f"model.layers.{i}.{sub}"] = target
        return targets

    def expected_weight_names(self) -> list[str]:
        return list(self._weight_targets())

    @torch.inference_mode()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the fused parameters; every expected weight must appear
        exactly with its HF shape, and no unknown weight may appear."""
        targets = self._weight_targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding is the output projection (as in transformers)
            if name not in targets:
                match = _LAYER_NAME.match(name)
                if match and int(match.group(1)) >= self.config.num_hidden_layers:
                    raise CheckpointError(
                        f"weight {name} is for layer {match.group(1)} but config.json has "
                        f"num_hidden_layers={self.config.num_hidden_layers}"
                    )
                raise CheckpointError(f"unexpected weight {name} for {self.config.architecture}")
            if name in loaded:
                raise CheckpointError(f"weight {name} appears twice in the checkpoint")
            param, first_row, num_rows = targets[name]
            expected = (num_rows, *param.shape[1:])
            if tuple(tensor.shape) != expected:
                raise CheckpointError(f"weight {name} has shape {tuple(tensor.shape)}, config.json implies {expected}")
            if self.quantizer is not None and self.quantizer.owns(param):
                self.quantizer.load_slice(param, first_row, tensor)
            else:
                param[first_row : first_row + num_rows].copy_(tensor)
            loaded.add(name)
        missing = [n for n in targets if n not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise CheckpointError(f"checkpoint is missing {len(missing)} weight(s): {shown}")
