"""SimulatedEngine: PagedEngine -- the real scheduler, block pool, prefix cache, KV events,
handoff operations and stats -- around SimulatedRunner instead of a model forward.

The model directory is still given: its tokenizer tokenizes (prompts, stop strings, output
text) and its config.json sizes the KV blocks (bytes per block, for the KV link) and the
vocabulary; its weights are never read. Torch is never imported on this path.

Not simulated (refused with a 400 naming the field, as an unsupported parameter): structured
output and prompt log-probabilities, which need real logits; speculative decoding is off;
LoRA adapters (loading one at runtime is refused with a LoraAdapterError).
"""

from __future__ import annotations

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.engine_errors import LoraAdapterError
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.paged_engine import PagedEngine
from splitserve.engine.simulated.simulated_kv_cache import SimulatedKVCache
from splitserve.engine.simulated.simulated_runner import SimulatedRunner
from splitserve.engine.simulated.step_time_profile import StepTimeProfile
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams


class SimulatedEngine(PagedEngine):
    def __init__(self, config: EngineConfig):
        model_config = ModelConfig.from_pretrained(config.model)
        tokenizer = Tokenizer.from_pretrained(config.model)
        profile = StepTimeProfile.load(config.profile).for_tensor_parallel(config.tensor_parallel_size)
        speed = config.speed_factor
        kv_cache = SimulatedKVCache.for_model(model_config, config.dtype, config.block_size, profile, speed)
        eos = tokenizer.eos_token_ids or model_config.eos_token_ids
        vocab = min(model_config.vocab_size, tokenizer.vocab_size)
        runner = SimulatedRunner(profile, model_config.num_hidden_layers, vocab, eos, config.seed, speed)
        super().__init__(config, model_config, tokenizer, kv_cache, runner, speculator=None)
        self.profile = profile

    def make_sequence(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams | None,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> Sequence:
        if params is not None:
            if params.structured_output is not None:
                raise InvalidRequestError("structured output (response_format) is not simulated: use the real engine")
            if params.prompt_logprobs is not None:
                raise InvalidRequestError("prompt_logprobs (echo with logprobs) is not simulated: use the real engine")
        return super().make_sequence(prompt, prompt_token_ids, params, request_id, prefill_only)

    @property
    def simulated_seconds(self) -> float:
        """The profile's time of every step so far (wall time / speed_factor, ideally)."""
        return self.runner.simulated_seconds

    def load_lora_adapter(self, name: str, path: str) -> None:
        raise LoraAdapterError(f"LoRA adapter {name!r}: LoRA adapters are not simulated; use the real engine")

    def unload_lora_adapter(self, name: str) -> None:
        raise LoraAdapterError(f"LoRA adapter {name!r} is not served (LoRA adapters are not simulated)")
