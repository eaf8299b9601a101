"""ModelService: the ingress's one generation pipeline, protocol-neutral. HTTP and gRPC parse a
client's request into a GenerationRequest and render what comes back; everything between is
here, once: resolving the model (a LoRA adapter's name: its base model, the request's
SamplingParams.lora_adapter set to the adapter, which every layer below carries to the
prefill and decode engines), the priority (class, the request's own, else its tenant's),
validation, tenant admission with the one reservation formula, model routing, and dispatch of
one backend generation per choice (prompts x n).

As vLLM's OpenAIServing is a thin layer over AsyncLLM.generate and Ray Serve's ingress over
LLMServer, the frontends are thin layers over ModelService.generate.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field

import anyio
import msgspec

from splitserve.cluster.frontend.fanout import close_all
from splitserve.cluster.frontend.model_catalog import ModelCatalog
from splitserve.cluster.frontend.model_router.model_route_decision import ModelRouteDecision
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_binding import bind_route, decision_of
from splitserve.cluster.frontend.openai.protocol import choice_params
from splitserve.cluster.frontend.priority_class import RequestPriority, resolve_priority
from splitserve.cluster.frontend.serving_api import ChoiceRequest, GenerationAPI
from splitserve.cluster.request_error import invalid
from splitserve.cluster.tenants.tenant_gate import TenantTicket
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.invalid_request import InvalidRequestError
from splitserve.proto.messages.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerationRequest:
    """One API request as a frontend parsed it: what ModelService.generate takes."""

    model: str  # the name the client sent ("": the default model)
    prompts: list[list[int]]  # token ids of each prompt (completions may send several)
    params: SamplingParams  # the request's own; its priority is set by ModelService
    n: int = 1  # choices per prompt
    api_key: str | None = None  # the caller's bearer token
    run_as: str | None = None  # a batch line: the tenant it runs as (no key)
    label: str | None = None  # the client's own id for the request (x-request-id): only logged
    timeout_s: float | None = None  # the client's deadline (capped by request_timeout_s)
    priority_class: str | None = None  # interactive (None) or batch
    priority: int | None = None  # the request's own priority, over its class's and tenant's
    headers: Mapping[str, str] = field(default_factory=dict)  # HTTP headers / gRPC metadata (routes read them)
    tools: bool = False  # a chat request declaring tools (routes read it)
    received_at: float | None = None  # its arrival (perf_counter), before parsing: the first token's ingress stage

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def reserved_completion_tokens(self) -> int:
        """What a tenant's admission reserves for the completions: max_tokens per choice."""
        return (self.params.max_tokens or 0) * len(self.prompts) * self.n


class Generation:
    """A started request: one chunk source per choice (prompt-major), the tenant's headers, and
    the route's decision once its first chunk is in. close() ends whatever is still running."""

    def __init__(
        self, sources: list[AsyncGenerator[StreamChunk, None]], binding, routed: bool, ticket: TenantTicket | None
    ):
        self.sources, self.binding, self.routed, self.ticket = sources, binding, routed, ticket
        self.headers: dict[str, str] = dict(ticket.headers) if ticket is not None else {}

    @property
    def decision(self) -> ModelRouteDecision | None:
        """Known after the first chunk (a cascade decides only then); None for a served model."""
        return decision_of(self.binding)

    def settle(self) -> None:
        """The API request is over: its tenant ticket settles once every choice has ended."""
        if self.ticket is not None:
            self.ticket.close()

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            await close_all(self.sources)
        self.settle()


class ModelService:
    def __init__(self, catalog: ModelCatalog, default: GenerationAPI):
        """default: the model of a request that names none, whose cfg (the deployment's
        settings) and tenant gate the service uses."""
        self.catalog, self.default = catalog, default
        self.cfg = default.cfg
        self.tenants = getattr(default, "tenants", None)

    def resolve(self, model: str) -> GenerationAPI:
        """The API serving `model` ("": the default); RequestError NOT_FOUND for an unknown one."""
        return self.catalog.resolve(model) if model else self.default

    async def generate(self, request: GenerationRequest) -> Generation:
        """Starts the request's generations (chunks flow when a source is read). Raises
        InvalidRequestError / RequestError / TenantRefusal before anything runs on a refusal."""
        api = self.resolve(request.model)
        for prompt in request.prompts:  # every prompt is checked before anything is admitted
            api.validate(prompt, request.params)
        rank = self._priority(request, request.priority)
        ticket = await self._admit(request, api)
        try:
            if ticket is not None and request.priority is None and ticket.priority:
                rank = self._priority(request, ticket.priority)
            params = msgspec.structs.replace(
                request.params, priority=rank.priority, lora_adapter=self.catalog.lora_adapter(request.model)
            )
            choices = [(prompt, choice_params(params, i)) for prompt in request.prompts for i in range(request.n)]
            tenant = None if ticket is None else ticket.tenant.name
            features = RequestFeatures(
                request.prompts[0], params, len(choices), tenant, dict(request.headers), request.tools
            )
            binding = bind_route(api, features)
            sources = [
                binding.generate(
                    ChoiceRequest(
                        prompt,
                        choice,
                        request.label,
                        request.api_key,
                        request.timeout_s,
                        rank.sheddable,
                        None if ticket is None else ticket.part(index // request.n),
                        request.received_at,
                    )
                )
                for index, (prompt, choice) in enumerate(choices)
            ]
        except BaseException:
            if ticket is not None:
                ticket.close()
            raise
        return Generation(sources, binding, binding is not api, ticket)

    def _priority(self, request: GenerationRequest, explicit: int | None) -> RequestPriority:
        try:
            return resolve_priority(self.cfg.priority, request.priority_class, explicit)
        except InvalidRequestError as exc:
            raise invalid(str(exc)) from None

    async def _admit(self, request: GenerationRequest, api: GenerationAPI) -> TenantTicket | None:
        """The tenant's admission: prompt tokens + max_tokens per choice reserved, settled to
        the real count when the request ends. A batch line is admitted as its tenant."""
        if self.tenants is None:
            return None
        model = request.model or api.model_name
        prompt_tokens, completion = request.prompt_tokens, request.reserved_completion_tokens()
        if request.run_as is not None:
            return await self.tenants.admit_tenant(request.run_as, model, prompt_tokens, completion)
        return await self.tenants.admit(request.api_key, model, prompt_tokens, completion)
