"""Adapter-aware routing on a real `splitserve serve` (Ray, CPU): 2 decode replicas (each
prefilling its prompts), 2 adapters and ONE device slot per replica (`--max-loras 1
--max-cpu-loras 2`), so the replicas' residency differs and what the router knows of it comes
from their own pushed state (EngineStats.lora_device_adapters with their KV events). Requests
come in pairs per adapter (sql, sql, mlp, mlp, ...): the kv policy keeps each adapter on the
replica that holds it, round-robin alternates replicas and finds the other adapter in the slot.
The router's adapter-hit share, read from /metrics, is higher under kv."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import transformers
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.peft_adapters import write_peft_adapter
from tests.helpers.serve_process import ServeProcess
from tests.helpers.transformers_checkpoint import SERVABLE_SHAPE, write_transformers_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]  # its helpers start `splitserve serve`
ADAPTERS = {"sql": (1, 8, 16, ["q_proj", "v_proj"]), "mlp": (2, 4, 8, ["gate_proj", "up_proj"])}
ROUNDS = 6
# Pacing between requests, so each replica's pushed state (every 0.1 s when it changed)
# reaches the router before the next request: a late one only turns a hit into a miss.
STATE_PUSH_WAIT_S = 0.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-routing")
    base = root / "base"
    write_transformers_checkpoint(transformers.LlamaConfig(**SERVABLE_SHAPE), base, seed=7, tokenizer=True)
    return base, {name: write_peft_adapter(base, root / name, *spec) for name, spec in ADAPTERS.items()}


def hit_share(checkpoint, tmp_path, policy: str) -> float:
    base, adapters = checkpoint
    modules = [f"{name}={path}" for name, path in adapters.items()]
    flags = ("--enable-lora", "--lora-modules", *modules, "--max-loras", "1", "--max-cpu-loras", "2")
    pools = ("--prefill-replicas", "0", "--decode-replicas", "2", "--router", policy)
    log_dir = tmp_path / policy  # each server its own folder: its own state store
    log_dir.mkdir()
    proc = ServeProcess(str(base), log_dir / "serve.log", *flags, *pools)
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", timeout=120, max_retries=0)
        for round_ in range(ROUNDS):
            for name in ADAPTERS:
                for repeat in range(2):
                    prompt = [5 + (11 * round_ + 3 * repeat + j) % 400 for j in range(24)]
                    client.completions.create(model=name, prompt=prompt, max_tokens=2, temperature=0)
                    time.sleep(STATE_PUSH_WAIT_S)
        text = httpx.get(f"{proc.base_url}/metrics", timeout=10).text
        samples = {f.name: f.samples for f in text_string_to_metric_families(text)}
        routes = sum(s.value for s in samples["splitserve_router_lora_routes"] if s.name.endswith("_total"))
        hits = sum(s.value for s in samples.get("splitserve_router_lora_adapter_hits", []) if s.name.endswith("_total"))
        assert routes == ROUNDS * len(ADAPTERS) * 2
        return hits / routes
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


def test_kv_routing_keeps_adapters_where_they_are_resident(checkpoint, tmp_path):
    # The two servers run side by side (each a local cluster on free ports, FrontDoor): most of
    # a run is its pacing sleeps, so one server's sleeps overlap the other's compute.
    with ThreadPoolExecutor(2) as pool:
        kv_share, round_robin_share = (pool.submit(hit_share, checkpoint, tmp_path, p) for p in ("kv", "round-robin"))
        kv, round_robin = kv_share.result(), round_robin_share.result()
    assert kv > round_robin + 0.3, (kv, round_robin)
