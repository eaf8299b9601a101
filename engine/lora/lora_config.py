"""EngineConfig's LoRA settings checked (torch-free: EngineConfig is built where no torch is)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from splitserve.engine.config import ConfigError

if TYPE_CHECKING:
    from splitserve.engine.config import EngineConfig


def check_lora_settings(config: EngineConfig) -> None:
    """One-line ConfigError for LoRA settings this engine cannot serve."""
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    modules = config.lora_modules or {}
    if not isinstance(modules, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in modules.items()
    ):
        raise ConfigError(f"lora_modules must map adapter names to directories, got {modules!r}")
    if modules and not config.enable_lora:
        raise ConfigError("lora_modules needs enable_lora")
    if not config.enable_lora:
        return
    if len(modules) > config.max_loras:
        # Until adapters can wait in a host cache, every one served holds a device slot.
        raise ConfigError(f"{len(modules)} LoRA adapters but max_loras={config.max_loras}: each needs a device slot")
    if config.tensor_parallel_size > 1:
        raise ConfigError("enable_lora with tensor_parallel_size > 1 is not supported yet")
