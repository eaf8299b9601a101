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
    cpu = config.max_cpu_loras
    if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < config.max_loras):
        # vLLM's rule: the host cache holds at least what the device's slots hold.
        raise ConfigError(f"max_cpu_loras must be an integer >= max_loras={config.max_loras}, got {cpu!r}")
    if config.tensor_parallel_size > 1:
        raise ConfigError("enable_lora with tensor_parallel_size > 1 is not supported yet")
