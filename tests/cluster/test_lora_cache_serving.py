"""More LoRA adapters than device slots, served by a real `splitserve serve` (Ray, CPU, 1P+1D,
every prompt prefilled remotely) under the official `openai` client: three `peft` adapters on
--max-loras 1 and --max-cpu-loras 2, so every adapter switch evicts a slot and the host cache
re-reads an adapter from its directory. Each adapter gives transformers + peft's greedy
tokens alone, mixed with the others and the base (requests wait for the one slot: no step runs
two adapters, none starves), and again after it was evicted from both tiers; /metrics counts
adapter loads and evictions by tier and times every load; the block pools end at baseline."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from splitserve.engine.io.tokenizer import Tokenizer
from tests.cluster import test_lora_serving
from tests.cluster.test_lora_serving import ADAPTERS, MAX_TOKENS, PATHS, PROMPT, TIMEOUT_S, _at_baseline, _samples
from tests.helpers.cluster import wait_until
from tests.helpers.serve_process import ServeProcess

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
checkpoint = test_lora_serving.checkpoint  # the base, its three adapters and peft's tokens
TIERS = ("device", "host")


def _tier_series(base_url: str) -> dict[tuple[str, str, str], float]:
    """(series, pool, tier) -> value of the LoRA tier series."""
    return {
        (s.name, s.labels["pool"], s.labels["tier"]): s.value
        for name in ("splitserve_lora_loads", "splitserve_lora_evictions", "splitserve_lora_load_seconds")
        for s in _samples(base_url).get(name, [])
        if s.name.endswith(("_total", "_count"))
    }


def test_three_adapters_on_one_slot_give_peft_tokens_and_count_loads_by_tier(checkpoint, tmp_path):
    base, adapters, expected = checkpoint
    modules = [f"{name}={adapter}" for name, adapter in adapters.items()]
    flags = ("--enable-lora", "--lora-modules", *modules, "--max-loras", "1", "--max-cpu-loras", "2")
    proc = ServeProcess(str(base), tmp_path / "serve.log", *flags, "--router", "kv", *PATHS["disaggregated"])
    try:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0)
        tokenizer = Tokenizer.from_pretrained(str(base))

        def complete(model: str | None) -> str:
            answer = client.completions.create(
                model=model or str(base),
                prompt=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return answer.choices[0].text

        want = {name: tokenizer.decode(expected[name]) for name in [None, *ADAPTERS]}
        # Alone, in turn: each adapter evicts the one before from the slot (and, the third, the
        # first from the host cache of two).
        assert {name: complete(name) for name in [None, *ADAPTERS]} == want
        # Concurrent: every adapter three times and the base, on one slot per replica.
        mixed = [None, *ADAPTERS] * 3
        with ThreadPoolExecutor(len(mixed)) as pool:
            assert list(pool.map(complete, mixed)) == [want[name] for name in mixed]
        # "sql" out of both tiers (qv and mlp were the last two), then loaded back: the same tokens.
        assert [complete(name) for name in ("mlp", "qv", "sql")] == [want["mlp"], want["qv"], want["sql"]]
        # No wall-clock bound on these waits (a busy machine probes late): the test's timeout cancels.
        wait_until(lambda: _at_baseline(proc.base_url), None, "block pools not back to baseline", interval_s=0.2)

        def counted() -> bool:  # the controller's probes have seen the last load
            series = _tier_series(proc.base_url)
            return all(
                series.get(("splitserve_lora_loads_total", pool, "device"), 0) >= 6 for pool in ("prefill", "decode")
            )

        wait_until(counted, None, lambda: f"adapter loads not exported: {_tier_series(proc.base_url)}", interval_s=0.2)

        scraped: list[dict] = []

        def timed() -> bool:  # a scrape is not atomic with the probe that folds in a late load
            scraped[:] = [_tier_series(proc.base_url)]
            return all(
                scraped[0][("splitserve_lora_loads_total", pool, tier)]
                == scraped[0][("splitserve_lora_load_seconds_count", pool, tier)]
                for pool in ("prefill", "decode")
                for tier in TIERS
            )

        wait_until(timed, None, lambda: f"adapter loads and timed loads never agree: {scraped}", interval_s=0.2)
        (series,) = scraped  # the scrape that agreed: the next may come from behind another ingress
        for pool in ("prefill", "decode"):
            for tier in TIERS:
                loads = series[("splitserve_lora_loads_total", pool, tier)]
                assert loads == series[("splitserve_lora_load_seconds_count", pool, tier)], (pool, tier)
                assert series[("splitserve_lora_evictions_total", pool, tier)] >= 1, (pool, tier)
            # Three adapters read at start, then at least the re-read of "sql" into the host cache.
            assert series[("splitserve_lora_loads_total", pool, "host")] >= 4
    finally:
        assert proc.stop() == 0, proc.log_path.read_text()[-3000:]
