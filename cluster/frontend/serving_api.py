"""What the frontends call on their backend, as Protocols: GenerationAPI for the gRPC frontend,
ServingAPI (GenerationAPI plus tokenization, chat templates and /metrics) for the OpenAI HTTP
one. ServingBackend (cluster/frontend/backend.py) implements ServingAPI over the cluster; the
frontend tests run the real apps over test doubles of each (tests/helpers/http_api.py,
tests/helpers/grpc_client.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.tenants.metered_generation import metered
from splitserve.cluster.tenants.tenant_gate import TicketPart
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChoiceRequest:
    """One generation of an API request (one choice of one prompt), as each layer below the
    ModelService passes it whole: a route binding, a cascade, the backend."""

    prompt_token_ids: list[int]
    params: SamplingParams
    label: str | None = None  # the client's own id for the request: only logged
    api_key: str | None = None  # per-key admission (without tenants)
    timeout_s: float | None = None  # the client's deadline, capped by request_timeout_s
    sheddable: bool = False  # batch work: outside the interactive limits, only where there is headroom
    tenant_part: TicketPart | None = None  # the tenant request's share, settled when it ends
    received_at: float | None = None  # the API request's arrival (perf_counter): the ingress stage's start

    def metered(self, chunks: AsyncIterator[StreamChunk]) -> AsyncIterator[StreamChunk]:
        """chunks, telling the tenant part what they used when they end (however they end)."""
        return chunks if self.tenant_part is None else metered(chunks, self.tenant_part)

    def unmetered(self) -> ChoiceRequest:
        """The same generation for the layer below, which must not meter it a second time."""
        return self if self.tenant_part is None else dataclasses.replace(self, tenant_part=None)

    def with_params(self, params: SamplingParams) -> ChoiceRequest:
        return dataclasses.replace(self, params=params)


class GenerationAPI(Protocol):
    cfg: ServeConfig
    model_name: str  # the model id clients send
    max_model_len: int
    ingress_id: str  # names this ingress replica in every response

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids; RequestError(INVALID) for an empty or malformed text."""
        ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """RequestError(INVALID) naming the field when the request cannot be served."""
        ...

    def health(self) -> dict[str, Any]:
        """`ok`, `serving` and per-pool replica counts (see ServingBackend.health)."""
        ...

    def generate(self, choice: ChoiceRequest) -> AsyncIterator[StreamChunk]:
        """Admit, stream; raises RequestError (before the first chunk on refusal). The choice
        was validated once, by ModelService through validate(), before any of it was admitted."""
        ...


class ServingAPI(GenerationAPI, Protocol):
    tokenizer: Tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]: ...

    async def render_metrics(self) -> bytes: ...
