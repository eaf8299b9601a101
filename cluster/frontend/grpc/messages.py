"""The gRPC messages and the engine's types: GenerateRequest -> SamplingParams (validated by
SamplingParams itself, as the HTTP API's are, so both front doors share one set of limits) and
StreamChunk -> GenerateResponse."""

from __future__ import annotations

from splitserve.proto import load_stubs
from splitserve.proto.messages.grammar_spec import GrammarSpec
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams

pb2, _ = load_stubs()
# Sampling fields declared `optional` in the .proto: unset means the SamplingParams default.
OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "speculative_decoding",
    "migration",
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
    try:
        return _spec_of(request, kind)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{kind}: {exc}") from None


def _spec_of(request: pb2.GenerateRequest, kind: str) -> GrammarSpec | None:
    if kind == "json_schema":
        return GrammarSpec.json_schema(request.json_schema)
    if kind == "json_object":
        return GrammarSpec("json_object") if request.json_object else None
    if kind == "choice":
        return GrammarSpec.choice(list(request.choice.choices))
    return GrammarSpec(kind, getattr(request, kind))


def oneof_conflict(descriptor, data: bytes) -> str | None:
    """Why a well-formed message sets more than one member of a oneof (None: it does not).
    Reads only the top-level field numbers of the wire bytes (already parsed once)."""
    numbers = _top_level_field_numbers(data)
    for oneof in descriptor.oneofs:
        present = sorted({f.name for f in oneof.fields if f.number in numbers})
        repeated = [f.name for f in oneof.fields if numbers.count(f.number) > 1]
        if len(present) > 1 or repeated:
            names = " and ".join(present) if len(present) > 1 else f"{repeated[0]} twice"
            return f"it sets {names} of the oneof {oneof.name}; give one"
    return None


def _top_level_field_numbers(data: bytes) -> list[int]:
    numbers, i, n = [], 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        numbers.append(key >> 3)
        wire = key & 7
        if wire == 0:
            _, i = _varint(data, i)
        elif wire == 1:
            i += 8
        elif wire == 2:
            size, i = _varint(data, i)
            i += size
        elif wire == 5:
            i += 4
        else:  # groups: not in this proto; stop reading rather than guess
            break
    return numbers


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while i < len(data):
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return value, i


class GenerateResponses:
    """One stream's GenerateResponses. label: the client's request_id, echoed back; else the
    server's own id. include_first_token_stages (GenerateRequest.return_first_token_stages):
    the first chunk's stages go into the last message's usage."""

    def __init__(self, label: str | None, include_first_token_stages: bool) -> None:
        self.label = label
        self.include_first_token_stages = include_first_token_stages
        self.first_token_stages: dict[str, float] = {}

    def of(self, chunk: StreamChunk) -> pb2.GenerateResponse:
        if not self.first_token_stages:
            self.first_token_stages = dict(chunk.first_token_stages)
        response = generate_response(chunk, self.label)
        if chunk.finished and self.include_first_token_stages:
            response.usage.first_token_stages.update(self.first_token_stages)
        return response


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
