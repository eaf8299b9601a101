"""EngineProtocol: the engine as the prefill and decode workers (and their EngineLoop) use it.

Two engines implement it: LLMEngine (engine/llm_engine.py, the model on torch) and
SimulatedEngine (engine/simulated/simulated_engine.py, the same scheduler, block pool, prefix
cache and KV events around a step-time model instead of a forward). The workers are typed
against this Protocol only; tests/workers/test_engine_api_use.py checks by parsing their
source that they touch no engine attribute outside it.

Torch-free (a simulated replica must not import torch): the KV cache and the device are typed
`Any` here -- the transport that reads them knows which engine it serves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

from splitserve.engine.config import EngineConfig
from splitserve.engine.core.scheduler import ScheduledBatch
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.io.block_reservation import BlockReservation
from splitserve.engine.io.request_output import RequestOutput
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.handoff import PrefillResult
from splitserve.proto.messages.kv_events import KVEvent
from splitserve.proto.messages.sampling_params import SamplingParams

# Given the batch about to run, returns a per-layer callback (or None) for that step. The
# prefill worker uses it to send each layer's KV while the next layer computes.
LayerHookFactory = Callable[[ScheduledBatch], Callable[[int], None] | None]


@runtime_checkable
class EngineProtocol(Protocol):
    config: EngineConfig
    # What the KV transport reads (prefill) and writes (decode): the paged KV tensors of the
    # real engine, the block geometry alone of the simulated one.
    kv_cache: Any
    # Steps whose forward completed and whose tokens were taken in (with async scheduling a
    # step() call may only submit one).
    num_steps: int

    @property
    def device(self) -> Any:
        """Where the KV cache lives (the transport opens NCCL pairs for CUDA, gloo for CPU)."""
        ...

    # ---- requests ------------------------------------------------------------------------
    def make_sequence(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams | None,
        request_id: str | None = None,
        prefill_only: bool = False,
    ) -> Sequence:
        """A validated sequence (InvalidRequestError for bad input); prefill_only for a prefill
        replica's requests: it stops after its first token and keeps its blocks pinned."""
        ...

    def add_sequence(self, seq: Sequence) -> None: ...

    def abort(self, request_id: str) -> None:
        """Stop a request and free all it holds; unknown or finished ids are ignored."""
        ...

    def abort_all(self) -> list[str]:
        """Abort every request and reservation (the loop is ending); returns their ids."""
        ...

    def release_prefilled(self, request_id: str) -> None:
        """After the KV handoff: unpin a prefilled request's blocks (they stay cached)."""
        ...

    def prompt_block_ids(self, request_id: str, block_indices: Iterable[int]) -> list[int]: ...

    # ---- disaggregated decode: reserve, receive, admit ------------------------------------
    def reserve_prompt_blocks(self, seq: Sequence) -> BlockReservation | None: ...

    def release_reservation(self, request_id: str) -> None: ...

    def accept_first_token(self, request_id: str, first: PrefillResult) -> RequestOutput | None: ...

    def admit_prefilled(self, request_id: str, first: PrefillResult) -> RequestOutput | None: ...

    # ---- stepping ------------------------------------------------------------------------
    def has_unfinished(self) -> bool: ...

    def step(
        self,
        layer_hook: LayerHookFactory | None = None,
        deliver: Callable[[list[RequestOutput]], None] | None = None,
    ) -> list[RequestOutput]:
        """Schedule a batch, run it, post-process it; EngineStepError fails only that batch.
        With deliver, the outputs go to it (with async scheduling on another thread, while the
        next step's forward runs) and [] is returned."""
        ...

    # ---- prefix cache and load, for the router -------------------------------------------
    def take_events(self) -> list[KVEvent]: ...

    def snapshot(self) -> tuple[int, list[int]] | tuple[int, list[int], list[int]]: ...  # host hashes third

    def stats(self) -> EngineStats: ...

    # ---- LoRA adapters at runtime (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) ---
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve another adapter from now on; LoraAdapterError (one line) if it cannot be
        served, and nothing changes."""
        ...

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving an adapter; LoraAdapterBusyError while requests use it (it stays),
        LoraAdapterError if it is not served."""
        ...


def protocol_members() -> set[str]:
    """The names EngineProtocol declares: the whole engine API the workers may use."""
    names = {n for n in vars(EngineProtocol) if not n.startswith("_")}
    return names | set(EngineProtocol.__annotations__)
