"""What the engine and its loop raise when serving fails: one step (its batch's requests fail,
the engine serves on) or the whole loop (the replica is dead). Torch-free, so the ingress can
tell them apart without importing the engine."""

from __future__ import annotations

from splitserve.engine.config import ConfigError


class EngineStepError(RuntimeError):
    """An engine step raised. Every request of its batch was failed -- its blocks freed, its
    scheduler, sampler and detokenizer state dropped -- so the engine is consistent and serves
    the others on. `request_ids` names the failed requests; the step's exception is the cause."""

    def __init__(self, message: str, request_ids: list[str] | tuple[str, ...] = ()):
        super().__init__(message)
        self.request_ids = list(request_ids)

    def __reduce__(self):  # crosses Ray: keep request_ids through pickling
        return (type(self), (str(self), self.request_ids))


class LoraAdapterError(ConfigError):
    """An adapter this engine cannot serve (one line: the adapter, the reason). Here, torch-free,
    so a replica's worker and the simulated engine name it without importing torch."""


class LoraAdapterBusyError(RuntimeError):
    """A LoRA adapter cannot be unloaded: requests waiting or running use it (the caller
    unloads it once they are done; the adapter stays served meanwhile)."""


class EngineLoopStopped(RuntimeError):
    """The engine loop is not running: shut down, or stopped for good after a failure it could
    not recover from. Everything it held has been released. A request that got no output yet
    may be retried on another replica."""
