"""The colocated engine: prefill and decode in one process, the model run on torch. The
offline API and the baseline the disaggregated system is compared with; the workers run it.

Everything but the model lives in PagedEngine (engine/paged_engine.py): LLMEngine loads the
checkpoint, allocates the KV tensors and hands PagedEngine a ModelRunner. The prefill and
decode workers use it only through EngineProtocol (engine/engine_protocol.py);
tests/workers/test_engine_api_use.py checks that by parsing their source.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_protocol import LayerHookFactory
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.model.loader import load_model
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.paged_engine import PagedEngine
from splitserve.engine.spec.speculator import Speculator

__all__ = ["LLMEngine", "LayerHookFactory"]


class LLMEngine(PagedEngine):
    def __init__(self, config: EngineConfig):
        model, model_config = load_model(config.model, dtype=config.dtype, device=config.device)
        self.model = model
        tokenizer = Tokenizer.from_pretrained(config.model)
        kv_cache = KVCache(model_config, config)
        eos = tokenizer.eos_token_ids or model_config.eos_token_ids
        super().__init__(
            config,
            model_config,
            tokenizer,
            kv_cache,
            ModelRunner(model, kv_cache, config.seed, eos),
            Speculator.for_engine(config, model_config.vocab_size),
        )

    @classmethod
    def from_model_dir(cls, model: str, **kwargs) -> LLMEngine:
        return cls(EngineConfig(model=model, **kwargs))

    def generate(
        self, prompts: Iterable[str | Seq[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        with torch.inference_mode():
            return super().generate(prompts, params)

    @property
    def device(self) -> torch.device:
        """Where the KV cache lives (the transport opens NCCL pairs for CUDA, gloo for CPU)."""
        return self.kv_cache.device
