"""vLLM's utility endpoints: POST /tokenize, POST /detokenize, GET /version, in vLLM's shapes."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from splitserve.cluster.frontend.openai.protocol import ChatMessageParam, TokenId


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: Annotated[list[ChatMessageParam], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes the special tokens itself
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
