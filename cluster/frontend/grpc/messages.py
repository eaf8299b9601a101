"""The gRPC messages and the engine's types: GenerateRequest -> SamplingParams (validated by
SamplingParams itself, as the HTTP API's are, so both front doors share one set of limits) and
StreamChunk -> GenerateResponse."""

from __future__ import annotations

from splitserve.engine.io.sampling_params import InvalidRequestError, SamplingParams
from splitserve.engine.sample.grammar_spec import GrammarSpec
from splitserve.proto import load_stubs
from splitserve.proto.messages.handoff import StreamChunk

pb2, _ = load_stubs()
# Sampling fields declared `optional` in the .proto: unset means the SamplingParams default.
OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "speculative_decoding",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "top_logprobs",
)


def sampling_params_from(request: pb2.GenerateRequest) -> SamplingParams:
    """SamplingParams from a GenerateRequest; raises InvalidRequestError on bad values (token
    ids beyond the vocabulary are the backend's check, as for HTTP)."""
    explicit = {name: getattr(request, name) for name in OPTIONAL_SAMPLING_FIELDS if request.HasField(name)}
    if explicit.get("top_logprobs") and not request.logprobs:
        # As HTTP chat does: alternatives without the chosen token's own logprob are a client slip.
        raise InvalidRequestError("top_logprobs needs logprobs set to true")
    return SamplingParams(
        structured_output=structured_output_from(request),
        **explicit,
        stop=list(request.stop),
        stop_token_ids=list(request.stop_token_ids),
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logit_bias=dict(request.logit_bias),
    )


def structured_output_from(request: pb2.GenerateRequest) -> GrammarSpec | None:
    kind = request.WhichOneof("structured_output")
    if kind is None:
        return None
    if kind == "json_schema":
        return GrammarSpec.json_schema(request.json_schema)
    if kind == "json_object":
        return GrammarSpec("json_object") if request.json_object else None
    if kind == "choice":
        return GrammarSpec.choice(list(request.choice.choices))
    return GrammarSpec(kind, getattr(request, kind))


def generate_response(chunk: StreamChunk, label: str | None = None) -> pb2.GenerateResponse:
    """label: the client's request_id, echoed back; else the server's own id."""
    response = pb2.GenerateResponse(
        request_id=label or chunk.request_id,
        token_ids=chunk.token_ids,
        text=chunk.text,
        logprobs=chunk.logprobs,
        finished=chunk.finished,
        finish_reason=chunk.finish_reason or "",
        top_logprobs=[
            pb2.TopLogprobs(token_ids=[token for token, _ in top], logprobs=[logprob for _, logprob in top])
            for top in chunk.top_logprobs
        ],
    )
    if chunk.finished:
        response.usage.prompt_tokens = chunk.num_prompt_tokens
        response.usage.completion_tokens = chunk.num_output_tokens
        response.usage.cached_tokens = chunk.num_cached_tokens
    return response
