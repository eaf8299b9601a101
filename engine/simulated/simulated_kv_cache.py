"""SimulatedKVCache: the KV cache's geometry without its tensors.

What the simulated KV link needs: how many layers a transfer is sent in (layer-wise), how many
bytes a block holds, and how long moving them takes (the profile's link, slowed speed_factor
times). The block pool itself is the real one (engine/core), in PagedEngine.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.model_config import ModelConfig
from splitserve.engine.simulated.step_time_profile import StepTimeProfile

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SIMULATED_DEVICE = "simulated"


def kv_bytes_per_token(model_config: ModelConfig, dtype: str | None) -> int:
    """K and V of every layer: 2 x layers x KV heads x head dim x dtype bytes."""
    width = DTYPE_BYTES[dtype or model_config.dtype]
    return 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim * width


@dataclass(frozen=True)
class SimulatedKVCache:
    num_layers: int
    block_size: int
    bytes_per_block: int
    profile: StepTimeProfile
    speed_factor: float = 1.0
    device: str = SIMULATED_DEVICE

    @classmethod
    def for_model(
        cls, model_config: ModelConfig, dtype: str | None, block_size: int, profile: StepTimeProfile, speed: float
    ) -> SimulatedKVCache:
        per_token = profile.kv_bytes_per_token or kv_bytes_per_token(model_config, dtype)
        return cls(model_config.num_hidden_layers, block_size, per_token * block_size, profile, speed)

    def transfer_wall_s(self, num_blocks: int) -> float:
        """Wall-clock seconds to move num_blocks over the link (simulated seconds x speed_factor)."""
        return self.profile.transfer_s(num_blocks * self.bytes_per_block) * self.speed_factor
