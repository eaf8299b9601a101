"""Multi-LoRA served by a real `splitserve serve` (Ray, CPU, started outside the repository)
under the official `openai` client, colocated (decode prefills its prompts) and disaggregated
(1P+1D, every prompt prefilled remotely and its KV sent over): adapters written by `peft`
(init_lora_weights=False: they change the output) are listed in /v1/models with the base as
`parent`; each adapter, selected by its name as `model`, gives transformers + peft's greedy
tokens over completions and chat; concurrent requests mixing the adapters and the base each
equal their solo run; one gRPC request by adapter name gives the same tokens; an unknown name
stays 404; the block pools are back to baseline after; /metrics counts each adapter's requests,
every replica's slots in use, and the router's adapter hits (the replicas' reported adapters
reach the router with their KV events)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import openai
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.proto import load_stubs
from tests.helpers.cluster import wait_until
from tests.helpers.peft_adapters import peft_greedy, write_peft_adapter
from tests.helpers.serve_process import ServeProcess
from tests.helpers.transformers_checkpoint import SERVABLE_SHAPE, write_transformers_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
pb2, pb2_grpc = load_stubs()
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
# name -> (seed, r, lora_alpha, targets): ranks, scalings and targets that differ.
ADAPTERS = {
    "sql": (1, 8, 16, ATTENTION),
    "mlp": (2, 4, 8, ["gate_proj", "up_proj", "down_proj"]),
    "qv": (3, 16, 8, ["q_proj", "v_proj"]),
}
MAX_TOKENS = 8
PROMPT = [5 + (7 * j) % 500 for j in range(37)]  # two full blocks and a partial one
PATHS = {
    "colocated": ("--prefill-replicas", "0", "--decode-replicas", "1"),
    "disaggregated": ("--prefill-replicas", "1", "--decode-replicas", "1", "--local-prefill-threshold", "0"),
}
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The base checkpoint, its adapters, and transformers + peft's greedy tokens per adapter
    (None: the base) for PROMPT."""
    root = tmp_path_factory.mktemp("lora-serving")
    base = root / "base"
    write_transformers_checkpoint(transformers.LlamaConfig(**SERVABLE_SHAPE), base, seed=7, tokenizer=True)
    adapters = {
        name: write_peft_adapter(base, root / name, seed, r, alpha, targets)
        for name, (seed, r, alpha, targets) in ADAPTERS.items()
    }
    expected = {name: peft_greedy(base, path, PROMPT, MAX_TOKENS) for name, path in {None: None, **adapters}.items()}
    assert all(expected[name] != expected[None] for name in ADAPTERS)  # each adapter changes the tokens
    return base, adapters, expected


def _samples(base_url: str) -> dict[str, list]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _at_baseline(base_url: str) -> bool:
    samples = _samples(base_url)
    usage = [s.value for s in samples.get("splitserve_kv_block_usage", [])]
    names = ("splitserve_running_requests", "splitserve_frontend_inflight_requests")
    busy = [s.value for name in names for s in samples.get(name, [])]
    return bool(usage) and not any(usage) and not any(busy)


@pytest.mark.parametrize("path", list(PATHS))
def test_adapters_served_by_name_give_peft_tokens_alone_and_mixed(checkpoint, tmp_path, path):
    base, adapters, expected = checkpoint
    modules = [f"{name}={adapter}" for name, adapter in adapters.items()]
    flags = ("--enable-lora", "--lora-modules", *modules, "--max-loras", "4", "--max-lora-rank", "16")
    proc = ServeProcess(str(base), tmp_path / "serve.log", *flags, "--router", "kv", *PATHS[path])
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
        tokenizer = Tokenizer.from_pretrained(str(base))
        listed = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
        assert listed == {str(base): None, **dict.fromkeys(ADAPTERS, str(base))}

        def complete(model: str | None) -> str:
            answer = client.completions.create(
                model=model or str(base),
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert answer.model == (model or str(base))  # an adapter answers under its own name
            return answer.choices[0].text

        solo = {name: complete(name) for name in [None, *ADAPTERS]}
        for name, text in solo.items():
            assert text == tokenizer.decode(expected[name]), name
        # Concurrent: every adapter and the base twice, interleaved, each equal to its solo run.
        mixed = [None, *ADAPTERS] * 2
        with ThreadPoolExecutor(len(mixed)) as pool:
            answers = list(pool.map(complete, mixed))
        assert answers == [solo[name] for name in mixed]

        # Chat by adapter name: the template's prompt through the adapter, as peft computes it.
        messages = [{"role": "user", "content": "Which table holds the orders?"}]
        chat_ids = httpx.post(
            f"{proc.base_url}/tokenize", json={"model": "sql", "messages": messages}, timeout=30
        ).json()["tokens"]
        chat = client.chat.completions.create(
            model="sql", messages=messages, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
        )
        assert chat.model == "sql"
        assert chat.choices[0].message.content == tokenizer.decode(
            peft_greedy(base, adapters["sql"], chat_ids, MAX_TOKENS)
        )

        # gRPC, by adapter name: the same tokens as peft's.
        with grpc.insecure_channel(f"127.0.0.1:{proc.grpc_port}") as channel:
            stub = pb2_grpc.SplitServeStub(channel)
            request = pb2.GenerateRequest(
                model="qv", token_ids=pb2.TokenIds(ids=PROMPT), max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
            )
            assert [t for r in stub.Generate(request, timeout=TIMEOUT_S) for t in r.token_ids] == expected["qv"]
            cards = stub.Models(pb2.ModelsRequest(), timeout=TIMEOUT_S).models
            assert {c.id: c.parent for c in cards} == {str(base): "", **dict.fromkeys(ADAPTERS, str(base))}

        with pytest.raises(openai.NotFoundError) as refused:  # an unknown name stays 404
            complete("no-such-adapter")
        assert refused.value.code == "model_not_found"
        wait_until(lambda: _at_baseline(proc.base_url), None, "block pools not back to baseline", interval_s=0.2)
        # Requests per adapter as clients asked (solo, mixed, chat, gRPC), and every replica's
        # slots holding the three adapters.
        samples = _samples(proc.base_url)
        counted = {
            s.labels["adapter"]: s.value for s in samples["splitserve_lora_requests"] if s.name.endswith("_total")
        }
        assert counted == {"sql": 4, "mlp": 3, "qv": 4}
        slots = {s.labels["pool"]: s.value for s in samples["splitserve_lora_slots_in_use"]}
        assert slots == ({"decode": 3} if path == "colocated" else {"prefill": 3, "decode": 3})
        # The router's adapter-hit share: every LoRA request routed, per pool it was routed to,
        # found its adapter in the replica's reported device slots (every adapter holds a slot).
        pools = ["decode"] if path == "colocated" else ["prefill", "decode"]
        for name in ("splitserve_router_lora_routes", "splitserve_router_lora_adapter_hits"):
            by_pool = {s.labels["pool"]: s.value for s in samples[name] if s.name.endswith("_total")}
            assert by_pool == dict.fromkeys(pools, sum(counted.values())), name
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
