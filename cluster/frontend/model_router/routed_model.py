"""RoutedModel: a name clients send as `model` (an alias or a virtual model) that is not a model
itself but picks one of several served models per request. It is a ServingAPI (the frontends
and the model catalog treat it as one) by delegating to its targets: model facts to the first
(all must share one tokenizer, since token ids pass between them), validation to every target
that may answer, generation to the one its policy picks (`bind`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from splitserve.cluster.frontend.model_router.model_route_metrics import ModelRouteMetrics
from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.serving_api import ChoiceRequest, ServingAPI
from splitserve.proto.messages.handoff import StreamChunk
from splitserve.proto.messages.sampling_params import SamplingParams


class RoutedModel(ABC):
    def __init__(self, name: str, targets: dict[str, ServingAPI], metrics: ModelRouteMetrics):
        """targets: served model id -> its ServingAPI (every model this route may pick)."""
        if not targets:
            raise ValueError(f"model route {name!r} has no target model")
        self.name = self.model_name = name
        self.targets = dict(targets)
        self.metrics = metrics
        self.primary = next(iter(self.targets.values()))
        _check_one_tokenizer(name, self.targets)
        self.cfg = self.primary.cfg
        self.ingress_id = self.primary.ingress_id
        self.tokenizer = self.primary.tokenizer
        # The request must fit whichever model answers.
        self.max_model_len = min(api.max_model_len for api in self.targets.values())
        self.vocab_size = getattr(self.primary, "vocab_size", None)

    @abstractmethod
    def bind(self, features: RequestFeatures) -> Any:
        """The request bound to its model: a RouteBinding (or CascadeBinding) to generate on."""

    # ---- model facts: the first target's (one tokenizer) --------------------------------
    def encode(self, text: str) -> list[int]:
        return self.primary.encode(text)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.primary.tokenize(text, add_special_tokens)

    def render_chat(self, messages, tools=None, add_generation_prompt: bool = True, add_special_tokens: bool = False):
        return self.primary.render_chat(messages, tools, add_generation_prompt, add_special_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        for api in self.targets.values():
            api.validate(prompt_token_ids, params)

    async def check_constraint(self, spec, field: str, parts=None, deadline=None) -> None:
        await self.primary.check_constraint(spec, field, parts, deadline)  # type: ignore[attr-defined]

    def health(self) -> dict[str, Any]:
        states = {name: api.health() for name, api in self.targets.items()}
        return {
            "ok": all(s.get("ok") for s in states.values()),
            "serving": all(s.get("serving", s.get("ok")) for s in states.values()),
            "models": states,
        }

    async def render_metrics(self) -> bytes:
        return await self.primary.render_metrics()

    def generate(self, choice: ChoiceRequest) -> AsyncIterator[StreamChunk]:
        """One generation routed on what the prompt and params alone say (the ModelService,
        which knows the request's headers, tenant and choices, calls bind_route first)."""
        return self.bind(RequestFeatures(choice.prompt_token_ids, choice.params)).generate(choice)


def _check_one_tokenizer(name: str, targets: dict[str, ServingAPI]) -> None:
    vocabularies = {model: _vocabulary(api) for model, api in targets.items()}
    first_model, first = next(iter(vocabularies.items()))
    for model, vocabulary in vocabularies.items():
        if vocabulary != first:
            raise ValueError(
                f"model route {name!r}: models {first_model!r} and {model!r} have different tokenizers; "
                "a route's models must share one (the prompt's token ids go to whichever answers)"
            )


def _vocabulary(api: ServingAPI) -> object:
    to_json = getattr(api.tokenizer, "to_json", None)
    return to_json() if callable(to_json) else getattr(api.tokenizer, "vocab_size", None)
