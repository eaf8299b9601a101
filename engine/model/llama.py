"""Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3, Mixtral, Qwen3-MoE) over the paged KV cache."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.config import ConfigError
from splitserve.engine.model.checkpoint import CheckpointError
from splitserve.engine.model.layers import DecoderLayer, rms_norm, rms_norm_plus_one
from splitserve.engine.model.rope import RotaryEmbedding
from splitserve.engine.model.scripted_decode import ScriptedDecodeForward, decode_plan_applies
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops.attention import make_decode_plan
from splitserve.engine.ops.attention_metadata import AttentionMetadata, OutputRows
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.ops.onednn_packed_weight import OneDnnPackedWeight
from splitserve.engine.parallel.vocab_parallel import gather_vocab_logits, vocab_parallel_embedding
from splitserve.engine.quant.layerwise_quantizer import LayerwiseQuantizer
from splitserve.engine.quant.quantize import linear

if TYPE_CHECKING:
    from splitserve.engine.lora.lora_batch import LoraBatch
    from splitserve.engine.parallel.tp_group import TensorParallelGroup

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
        tensor_parallel: TensorParallelGroup | None = None,
    ):
        """quantization none|int8|fp8|int4: the decoder layers' matmul weights, quantized by
        load_weights as they arrive; embeddings, norms and lm_head stay in dtype.
        tensor_parallel: this rank's group; the model is then its shard (engine/parallel/):
        its heads, KV heads, intermediate and vocabulary rows, loaded from the checkpoint's
        matching slices, with the collectives that join the shards. None: the whole model."""
        super().__init__()
        if config.num_experts and config.quantization_config:
            # Pre-quantized checkpoints' tensors are read for dense projections only; the
            # experts quantize as they load instead (--quantization).
            raise ConfigError(
                f"{config.architecture} (mixture of experts) from a pre-quantized checkpoint is not supported; "
                "load the full-precision checkpoint with --quantization int8|int4|fp8"
            )
        self.config = config
        self.dtype = dtype
        self.quantization = quantization
        self.tensor_parallel = tensor_parallel
        linear_device = None if quantization == "none" else "meta"
        hidden = config.hidden_size
        layer_config, vocab_rows, all_reduce = config, config.vocab_size, None
        # A tensor-parallel shard's embedding is its vocabulary rows, or the whole table when
        # the plan replicates it (then its lookup needs no all-reduce).
        self._embedding_is_whole = tensor_parallel is None or tensor_parallel.plan.replicated_embedding
        if tensor_parallel is not None:
            plan = tensor_parallel.plan
            layer_config, vocab_rows, all_reduce = plan.local_config, plan.vocab_rows, tensor_parallel.all_reduce
        self.num_heads = layer_config.num_attention_heads  # this rank's
        embed_rows = config.vocab_size if self._embedding_is_whole else vocab_rows
        self.embed_tokens = nn.Parameter(
            torch.empty(embed_rows, hidden, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(layer_config, i, dtype, device, linear_device, all_reduce)
            for i in range(config.num_hidden_layers)
        )
        self.final_norm = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device), requires_grad=False)
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(
                torch.empty(vocab_rows, hidden, dtype=dtype, device=device), requires_grad=False
            )
        self.rotary = RotaryEmbedding(config, dtype, device)
        # Gemma 3: the sliding-window layers' rotary, by their own base and without scaling.
        self.local_rotary = (
            None
            if config.local_rope_theta is None
            else RotaryEmbedding(
                dataclasses.replace(config, rope_theta=config.local_rope_theta, rope_scaling=None), dtype, device
            )
        )
        arch = config.registered
        self.norm = rms_norm_plus_one if arch.norm_plus_one else rms_norm
        # Gemma 3 multiplies the embeddings by sqrt(hidden) rounded to their dtype, as HF does.
        self.embed_scale = torch.tensor(hidden**0.5).to(dtype) if arch.scaled_embeddings else None
        self._layer_list = list(self.layers)  # plain list: cheaper to iterate in the hot loop
        self._windows = {layer.window for layer in self._layer_list}  # each gets its decode plan
        # Set by use_scripted_decode (engine/model/scripted_decode.py) once the weights are final.
        self._scripted_decode: ScriptedDecodeForward | None = None
        self.quantizer = (
            None
            if quantization == "none"
            else LayerwiseQuantizer(self._matmul_modules(), DecoderLayer.LINEAR_WEIGHTS, quantization, dtype, device)
        )

    def _matmul_modules(self) -> list[nn.Module]:
        """The modules holding decoder matmul weights (DecoderLayer.LINEAR_WEIGHTS, where they
        have them): the layers, and each mixture-of-experts layer's experts."""
        experts = [expert for layer in self._layer_list if layer.moe is not None for expert in layer.moe.experts]
        return [*self._layer_list, *experts]

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
        lora: LoraBatch | None = None,
        output_rows: list[int] | None = None,
    ) -> torch.Tensor:
        """input_ids/positions int64 [T] -> final hidden states [T, hidden].

        Every layer writes the new tokens' K/V at meta.slot_mapping before attending;
        on_layer_done(i) runs as soon as layer i's K/V is in the cache, so a KV sender can ship
        layer i while later layers compute. lora: the step's adapter tokens (engine/lora/),
        whose LoRA deltas every layer adds; the scripted decode has none, so it steps aside.
        output_rows: only these rows' hidden states are wanted, [len(output_rows), hidden] in
        that order: the last layer computes them alone once every row's K/V is written
        (OutputRows; a prefill's rows but one skip its attention and MLP). Not with lora or
        under tensor parallelism (the follower ranks run every row).
        """
        if output_rows is not None and (lora is not None or self.tensor_parallel is not None):
            raise ValueError("output_rows is not supported with LoRA or tensor parallelism")
        if (
            on_layer_done is None
            and lora is None
            and output_rows is None
            and self._scripted_decode is not None
            and decode_plan_applies(meta, kv_cache)
        ):
            # CPU decode: the same ops as below as one TorchScript call, which holds no GIL.
            return self._scripted_decode(input_ids, positions, kv_cache, meta)
        scripted = self._scripted_decode
        if scripted is not None and on_layer_done is None and lora is None and output_rows is not None:
            if scripted.prefill_applies(meta, kv_cache, output_rows):  # one fresh prompt, likewise
                return scripted.prefill(input_ids, positions, kv_cache, meta, output_rows)
        if self._embedding_is_whole:
            hidden = F.embedding(input_ids, self.embed_tokens)
        else:
            assert self.tensor_parallel is not None
            hidden = vocab_parallel_embedding(input_ids, self.embed_tokens, self.tensor_parallel)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        cos, sin = self.rotary.cos_sin(positions)
        local = cos, sin
        if self.local_rotary is not None:
            local = self.local_rotary.cos_sin(positions)
        # Block tables are the same for every layer: index them once per step (per window).
        plans = {w: make_decode_plan(meta, hidden, kv_cache.key_cache(0), self.num_heads, w) for w in self._windows}
        rows = None if output_rows is None else OutputRows.of(meta, output_rows)
        last = len(self._layer_list) - 1
        for i, layer in enumerate(self._layer_list):
            layer_cos, layer_sin = local if layer.sliding else (cos, sin)
            key_cache, value_cache = kv_cache.key_cache(i), kv_cache.value_cache(i)
            plan = plans[layer.window]
            layer_rows = rows if i == last else None
            hidden = layer(
                hidden, layer_cos, layer_sin, key_cache, value_cache, meta, on_layer_done, plan, lora, layer_rows
            )
        return self.norm(hidden, self.final_norm, self.config.rms_norm_eps)

    @property
    def selects_output_rows(self) -> bool:
        """Whether forward takes output_rows: not a tensor-parallel shard's."""
        return self.tensor_parallel is None

    def use_scripted_decode(self) -> bool:
        """Run CPU pure-decode steps as one TorchScript call (engine/model/scripted_decode.py),
        where this model's weights allow it. Call once the weights are loaded (and packed).
        A tensor-parallel shard has none: its step runs collectives between the layers."""
        if self.tensor_parallel is not None or not self.config.registered.scripted_decode:
            return False
        self._scripted_decode = ScriptedDecodeForward.build(self)
        return self._scripted_decode is not None

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]. A normal tensor (no_grad, not inference
        mode) so that samplers may modify it in place. A tensor-parallel shard gathers its
        vocabulary rows' logits on the driver, while every other rank runs share_logits."""
        logits = linear(hidden, self.lm_head).float()
        if self.tensor_parallel is not None:
            gathered = gather_vocab_logits(logits, self.tensor_parallel)
            if gathered is None:
                raise RuntimeError(f"rank {self.tensor_parallel.rank} is not the driver: it calls share_logits")
            logits = gathered
        cap = self.config.final_logit_softcapping
        if cap:  # Gemma: logits squashed into (-cap, cap)
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    @torch.no_grad()
    def share_logits(self, hidden: torch.Tensor) -> None:
        """A follower rank's part of the driver's compute_logits: its vocabulary rows' logits."""
        assert self.tensor_parallel is not None
        gather_vocab_logits(linear(hidden, self.lm_head).float(), self.tensor_parallel)

    def pack_matmul_weights(self) -> int:
        """Reorder the full-precision matmul weights for oneDNN (engine/ops/onednn_packed_weight.py),
        once the checkpoint is loaded; quantized weights and a tied lm_head (it is also the
        embedding table, which must stay a plain tensor) are left as they are. Returns how many
        weights were packed."""
        owners = [
            (module, name)
            for module in self._matmul_modules()
            for name in DecoderLayer.LINEAR_WEIGHTS
            if hasattr(module, name)  # a mixture-of-experts layer has no dense MLP weights; its experts do
        ]
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
            "model.embed_tokens.weight": (self.embed_tokens, 0, self._embed_rows_loaded),
            "model.norm.weight": (self.final_norm, 0, self.final_norm.shape[0]),
        }
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head, 0, self._vocab_rows_loaded)
        for i, layer in enumerate(self._layer_list):
            for sub, target in layer.weight_slices().items():
                targets[f"model.layers.{i}.{sub}"] = target
        return targets

    @property
    def _embed_rows_loaded(self) -> int:
        return self.config.vocab_size if self._embedding_is_whole else self._vocab_rows_loaded

    @property
    def _vocab_rows_loaded(self) -> int:
        """Embedding / lm_head rows the checkpoint fills (a shard's last rank pads its rows)."""
        if self.tensor_parallel is None:
            return self.embed_tokens.shape[0]
        return self.tensor_parallel.plan.vocab_rows_loaded

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
