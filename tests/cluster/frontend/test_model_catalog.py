"""ModelCatalog (names -> ServingAPI, 404 model_not_found) and the replica-wide Admission
that every model's backend shares, on plain objects (the cluster test is
tests/cluster/test_several_models.py)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.frontend.admission import Admission
from splitserve.cluster.frontend.model_catalog import MODEL_NOT_FOUND, ModelCatalog
from splitserve.cluster.frontend.model_service import GenerationRequest, ModelService
from splitserve.cluster.request_error import ErrorKind, RequestError
from splitserve.proto.messages.sampling_params import SamplingParams


class _Model:
    """Just what the catalog reads of a ServingAPI."""

    def __init__(self, name: str, ok: bool = True):
        self.model_name, self.max_model_len, self._ok = name, 128, ok

    def health(self) -> dict:
        pools = {"decode": {"ok": self._ok, "live": int(self._ok)}}
        state = {"ok": self._ok, "serving": self._ok, "pools": pools}
        return state if self._ok else {**state, "reason": "the decode pool has 0 live replica(s)"}


def test_resolve_register_and_served_in_order():
    small, large = _Model("small"), _Model("large")
    catalog = ModelCatalog.of(small, large)
    alias = _Model("large")  # e.g. an alias object of the other helper's router
    catalog.register("auto", alias)
    assert catalog.served() == ["small", "large", "auto"]
    assert catalog.resolve("large") is large and catalog.resolve("auto") is alias and catalog.default is small
    with pytest.raises(RequestError) as refused:
        catalog.resolve("gamma")
    error = refused.value
    assert (error.kind, error.code, error.param) == (ErrorKind.NOT_FOUND, MODEL_NOT_FOUND, "model")
    assert "'gamma'" in error.message and "'small', 'large', 'auto'" in error.message
    for name in ("small", "auto", ""):
        with pytest.raises(ValueError):
            catalog.register(name, small)


def test_health_is_the_model_s_own_for_one_and_per_model_for_several():
    one = ModelCatalog.of(_Model("small"))
    assert one.health() == _Model("small").health()  # a deployment of one model: as before
    two = ModelCatalog.of(_Model("small"), _Model("large", ok=False))
    state = two.health()
    assert not state["ok"] and state["serving"]  # one model down: degraded, still serving
    assert state["degraded"] == ["large"] and state["reason"].startswith("large: ")
    assert set(state["models"]) == {"small", "large"}
    assert set(state["pools"]) == {"small/decode", "large/decode"}


def test_admission_is_one_queue_for_every_model():
    admission = Admission(ServeConfig(max_queued_requests=2, api_key="sk-op", max_requests_per_key=1))
    keys = [admission.admit("sk-a", sheddable=False), admission.admit("sk-b", sheddable=False)]
    with pytest.raises(RequestError) as full:
        admission.admit("sk-c", sheddable=False)  # whatever model it asks for
    assert full.value.kind == ErrorKind.OVERLOADED
    batch = admission.admit("sk-c", sheddable=True)  # batch work is outside the queue
    admission.release(keys[0], sheddable=False)
    with pytest.raises(RequestError, match="this API key"):
        admission.admit("sk-b", sheddable=False)  # its key is at max_requests_per_key
    admission.release(admission.admit("sk-a", sheddable=False), sheddable=False)
    admission.release(keys[1], sheddable=False)
    admission.release(batch, sheddable=True)
    assert (admission.num_inflight, admission.num_sheddable_inflight) == (0, 0)


class _LoraModel(_Model):
    """A model whose config serves LoRA adapters; generate records each choice's params."""

    def __init__(self, name: str, adapters: dict[str, str]):
        super().__init__(name)
        self.cfg = ServeConfig(served_model_name=name, enable_lora=True, lora_modules=adapters)
        self.seen: list = []

    def validate(self, prompt_token_ids, params) -> None:
        pass

    async def generate(self, choice):
        self.seen.append(choice.params)
        return
        yield  # an async generator: the service reads its chunks (none here)


def test_lora_adapters_resolve_to_their_base_and_set_the_requests_adapter():
    base = _LoraModel("base", {"sql": "/a/sql", "chat": "/a/chat"})
    catalog = ModelCatalog.of(base)
    assert catalog.served() == ["base", "sql", "chat"]
    assert catalog.resolve("sql") is base and catalog.parent("sql") == "base" and catalog.parent("base") is None
    assert catalog.lora_adapter("chat") == "chat" and catalog.lora_adapter("base") is None
    with pytest.raises(ValueError, match="already served"):
        catalog.register_adapter("base", "base")
    with pytest.raises(ValueError, match="'nowhere' is not a served model"):
        catalog.register_adapter("x", "nowhere")
    with pytest.raises(RequestError) as refused:
        catalog.resolve("sqll")
    assert refused.value.kind == ErrorKind.NOT_FOUND and "'base', 'sql', 'chat'" in refused.value.message

    async def run(model: str) -> None:
        service = ModelService(catalog, base)
        params = SamplingParams(max_tokens=1)
        generation = await service.generate(GenerationRequest(model=model, prompts=[[1, 2]], params=params))
        async for _ in generation.sources[0]:
            pass
        await generation.close()

    for model in ("sql", "base", ""):
        asyncio.run(run(model))
    assert [p.lora_adapter for p in base.seen] == ["sql", None, None]


def test_adapters_loaded_and_unloaded_at_runtime_follow_the_controllers_list():
    base = _LoraModel("base", {"sql": "/a/sql"})
    catalog = ModelCatalog.of(base)
    catalog.set_adapters("base", ["sql", "fr"])  # "fr" loaded at runtime
    assert catalog.served() == ["base", "sql", "fr"] and catalog.parent("fr") == "base"
    assert catalog.resolve("fr") is base and catalog.lora_adapter("fr") == "fr"
    catalog.set_adapters("base", ["fr", "base"])  # "sql" unloaded; a model's name is never an adapter's
    assert catalog.served() == ["base", "fr"] and catalog.lora_adapter("base") is None
    with pytest.raises(RequestError) as refused:
        catalog.resolve("sql")
    assert refused.value.kind == ErrorKind.NOT_FOUND
