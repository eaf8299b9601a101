"""vLLM's utility routes on the HTTP frontend: POST /tokenize, POST /detokenize, GET /version.

Same request and response shapes as vLLM's server, so tools written for it (benchmark
harnesses count tokens through /tokenize) work unchanged. The API key, when configured,
guards /tokenize and /detokenize like /v1/ (RequestGuard); /version is public.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from fastapi import FastAPI

from splitserve.cluster.frontend.model_catalog import ModelCatalog
from splitserve.cluster.frontend.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from splitserve.cluster.frontend.serving_api import ServingAPI
from splitserve.cluster.request_error import invalid


def splitserve_version() -> str:
    try:
        return package_version("splitserve")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0.0.0+unknown"


def add_tokenize_routes(app: FastAPI, catalog: ModelCatalog, auth: list, errors: dict) -> None:
    """/tokenize and /detokenize with the tokenizer of the request's `model` (none: the default)."""

    def resolve(model: str | None) -> ServingAPI:
        return catalog.default if model is None else catalog.resolve(model)

    @app.post("/tokenize", response_model=TokenizeResponse, dependencies=auth, responses=errors)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        backend = resolve(body.model)
        if isinstance(body, TokenizeChatRequest):
            messages = [m.to_template_dict() for m in body.messages]
            ids = backend.render_chat(
                messages, add_generation_prompt=body.add_generation_prompt, add_special_tokens=body.add_special_tokens
            )
        else:
            ids = backend.tokenize(body.prompt, body.add_special_tokens)
        strs = backend.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=backend.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, dependencies=auth, responses=errors)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        backend = resolve(body.model)
        vocab_size = backend.tokenizer.vocab_size
        for token in body.tokens:
            if token >= vocab_size:
                raise invalid(f"token id {token} is outside the vocabulary [0, {vocab_size})")
        return DetokenizeResponse(prompt=backend.tokenizer.decode(body.tokens, skip_special_tokens=False))

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=splitserve_version())
