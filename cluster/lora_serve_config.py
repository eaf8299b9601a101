"""ServeConfig's LoRA settings (vLLM's names: --enable-lora, --lora-modules, --max-loras,
--max-lora-rank, --max-cpu-loras) checked where a deployment is described, torch-free: what the names must not
collide with, and what this deployment cannot serve yet. Each adapter's files are checked
against the model at start-up (cluster/cli/preflight.py) and again where a replica loads it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.cluster.config import ServeConfig


def check_lora_settings(cfg: ServeConfig) -> None:
    """ValueError (one line, a start-up error) for LoRA settings that cannot be served."""
    if not cfg.enable_lora:
        if cfg.lora_modules:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        return
    if cfg.models:
        raise ValueError("enable_lora with several models (models) is not supported yet: serve one base model")
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        # vLLM's rule: the host cache holds at least what the device's slots hold.
        raise ValueError(f"max_cpu_loras={cfg.max_cpu_loras} is below max_loras={cfg.max_loras}")
    for pool_name, pool in (("prefill", cfg.prefill), ("decode", cfg.decode)):
        if pool.tensor_parallel_size > 1:
            raise ValueError(f"enable_lora with {pool_name}.tensor_parallel_size > 1 is not supported yet")
    taken = {cfg.model_id: "the served model", **dict.fromkeys(cfg.aliases, "an alias")}
    taken.update(dict.fromkeys((route.name for route in cfg.model_routes), "a model route"))
    for name, path in cfg.lora_modules.items():
        if not name or not path:
            raise ValueError(
                f"lora_modules: an adapter needs a name and a directory (name=path), got {name!r}={path!r}"
            )
        if name in taken:
            raise ValueError(f"LoRA adapter {name!r}: the name is already {taken[name]}'s; give the adapter its own")
