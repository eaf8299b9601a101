"""What the frontends call on their backend, as Protocols: GenerationAPI for the gRPC frontend,
ServingAPI (GenerationAPI plus tokenization, chat templates and /metrics) for the OpenAI HTTP
one. ServingBackend (cluster/frontend/backend.py) implements ServingAPI over the cluster; the
frontend tests run the real apps over test doubles of each (tests/helpers/http_api.py,
tests/helpers/grpc_client.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from splitserve.cluster.config import ServeConfig
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.proto.messages.handoff import StreamChunk


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

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        label: str | None = None,
        api_key: str | None = None,
        timeout_s: float | None = None,
        sheddable: bool = False,
        tenant_part: Any = None,
    ) -> AsyncIterator[StreamChunk]:
        """Validate, admit, stream; raises RequestError (before the first chunk on refusal).
        sheddable: batch work (outside the interactive limits); tenant_part: the admitted
        tenant request's share, settled when the generation ends."""
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
