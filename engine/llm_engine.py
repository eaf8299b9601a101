"""The colocated engine: prefill and decode in one process, the model run on torch. The
offline API and the baseline the disaggregated system is compared with; the workers run it.

Everything but the model lives in PagedEngine (engine/paged_engine.py): LLMEngine loads the
checkpoint, allocates the KV tensors and hands PagedEngine a ModelRunner. The prefill and
decode workers use it only through EngineProtocol (engine/engine_protocol.py);
tests/workers/test_engine_api_use.py checks that by parsing their source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_errors import LoraAdapterBusyError
from splitserve.engine.engine_protocol import LayerHookFactory
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.kv_cache_sizing import kv_bytes_per_block, resolve_num_kv_blocks
from splitserve.engine.lora.lora_slots import LoraSlots
from splitserve.engine.lora.peft_checkpoint import LoraAdapterError
from splitserve.engine.model.loader import load_model
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.ops.host_kv_cache import HostKVCache, num_host_blocks
from splitserve.engine.ops.kv_cache import KVCache
from splitserve.engine.paged_engine import PagedEngine
from splitserve.engine.parallel.follower_extension import FollowerExtensionFactory
from splitserve.engine.parallel.tp_host_kv import TensorParallelHostKV
from splitserve.engine.parallel.tp_model import launch_tensor_parallel
from splitserve.engine.parallel.tp_ranks import FollowerLauncher, TensorParallelRanks
from splitserve.engine.speculative.speculator import Speculator
from splitserve.engine.step_threads import StepThreads
from splitserve.proto.messages.sampling_params import SamplingParams

__all__ = ["LLMEngine", "LayerHookFactory"]


class LLMEngine(PagedEngine):
    def __init__(
        self,
        config: EngineConfig,
        launch_followers: FollowerLauncher | None = None,
        follower_extension: FollowerExtensionFactory | None = None,
    ):
        # tensor_parallel_size > 1: this process is rank 0 of the sharded model, the other ranks
        # are processes it spawns (engine/parallel/), or its gang's rank actors that
        # launch_followers starts (a served replica); its KV cache holds only its KV heads.
        self.tensor_parallel: TensorParallelRanks | None = None
        if config.tensor_parallel_size > 1:
            config, model, model_config, cache_config = launch_tensor_parallel(
                config, launch_followers, follower_extension
            )
            self.tensor_parallel = model.ranks
        else:
            model, model_config = load_model(
                config.model, dtype=config.dtype, device=config.device, quantization=config.quantization
            )
            cache_config = model_config
        try:
            self._build(config, model, model_config, cache_config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, model, model_config: ModelConfig, cache_config: ModelConfig) -> None:
        self.model = model
        tokenizer = Tokenizer.from_pretrained(config.model)
        max_model_len = min(config.max_model_len or model_config.max_context_len, model_config.max_context_len)
        # kv_cache_memory_bytes: as many blocks as fit, known now that the model's shape is.
        sizing = (cache_config, config.block_size, config.kv_cache_dtype, config.dtype)
        blocks = resolve_num_kv_blocks(*sizing, config.num_kv_blocks, config.kv_cache_memory_bytes, max_model_len)
        # Its own lora_modules: adapters loaded and unloaded at runtime change it (the caller's stays).
        config = dataclasses.replace(config, num_kv_blocks=blocks, lora_modules=dict(config.lora_modules or {}))
        kv_cache = KVCache(cache_config, config)
        eos = tokenizer.eos_token_ids or model_config.eos_token_ids
        lora = (
            LoraSlots.from_engine_config(config, model_config, model.dtype, model.device)
            if config.enable_lora
            else None
        )
        super().__init__(
            config,
            model_config,
            tokenizer,
            kv_cache,
            ModelRunner(model, kv_cache, config.seed, eos, lora, step_threads(config, model)),
            Speculator.for_engine(config, model_config.vocab_size),
            kv_block_bytes=kv_bytes_per_block(*sizing),
            num_host_blocks=num_host_blocks(kv_cache, config.kv_offloading_size),
            make_host_mover=lambda num_host: (
                HostKVCache(kv_cache, num_host)
                if self.tensor_parallel is None
                else TensorParallelHostKV(kv_cache, num_host, self.tensor_parallel)
            ),
        )

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (they also stop when the engine is collected
        or the interpreter exits). The engine cannot step afterwards."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    @classmethod
    def from_model_dir(cls, model: str, **kwargs) -> LLMEngine:
        return cls(EngineConfig(model=model, **kwargs))

    def generate(
        self, prompts: Iterable[str | Seq[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        with torch.inference_mode():
            return super().generate(prompts, params)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve another LoRA adapter from now on (vLLM's /v1/load_lora_adapter): read and
        checked against the model, a one-line LoraAdapterError if it cannot be served (nothing
        changes then). The next request naming it runs with it."""
        lora, served = self.runner.lora, self.config.lora_modules
        if lora is None or served is None:
            raise LoraAdapterError(f"LoRA adapter {name!r}: this engine serves no adapters (enable_lora)")
        if name in served:
            raise LoraAdapterError(f"LoRA adapter {name!r} is already served (from {served[name]})")
        lora.register(name, path)
        served[name] = path

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter (vLLM's /v1/unload_lora_adapter). Refused while any
        request (waiting, running, or prefilled and held for its decode) uses it:
        LoraAdapterBusyError, and it stays served; LoraAdapterError if it is not served."""
        lora, served = self.runner.lora, self.config.lora_modules or {}
        if lora is None or name not in served:
            raise LoraAdapterError(f"LoRA adapter {name!r} is not served")
        using = [
            seq.request_id
            for seq in [*self.scheduler.requests.values(), *self._reserved.values()]
            if seq.params.lora_adapter == name
        ]
        if using:
            raise LoraAdapterBusyError(
                f"LoRA adapter {name!r} is in use by {len(using)} request(s); unload it when they finish"
            )
        lora.unload(name)
        del served[name]

    @property
    def device(self) -> torch.device:
        """Where the KV cache lives (the transport opens NCCL pairs for CUDA, gloo for CPU)."""
        return self.kv_cache.device


def step_threads(config: EngineConfig, model) -> StepThreads | None:
    """Each step's torch threads by its size, on a CPU engine that runs its model in this
    process alone (a tensor-parallel one's ranks keep theirs)."""
    if config.threaded_step_min_tokens == 0 or config.tensor_parallel_size > 1:
        return None
    if model.device.type != "cpu":
        return None
    return StepThreads(config.threaded_step_min_tokens)
