"""AdapterTarget: a LoRA adapter as the target of an alias or model route (`aliases:`,
`model_routes:`). The ModelService sets a request's adapter from the name the client sent,
which for an alias or route is not the adapter's; this target runs every choice routed to it
with its adapter (SamplingParams.lora_adapter) on its base model's backend, so prefix hashing,
routing and the engines see the adapter as for a request that named it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from splitserve.cluster.frontend.serving_api import ChoiceRequest, ServingAPI
from splitserve.proto.messages.handoff import StreamChunk


class AdapterTarget:
    def __init__(self, base: ServingAPI, adapter: str):
        """base: the ServingAPI of the adapter's base model; adapter: the adapter's served name."""
        self.base = base
        self.adapter = self.model_name = adapter

    def generate(self, choice: ChoiceRequest) -> AsyncIterator[StreamChunk]:
        params = msgspec.structs.replace(choice.params, lora_adapter=self.adapter)
        return self.base.generate(choice.with_params(params))

    def __getattr__(self, name: str) -> Any:
        # Everything else (tokenizer, limits, validation, health) is the base model's.
        return getattr(self.base, name)
