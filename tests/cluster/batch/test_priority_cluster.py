"""Priority on a real cluster (local Ray, CPU; one decode replica that prefills locally, room
for two running sequences): with both slots held by batch work, an interactive request
preempts one and gets its first token within a bound stated from the idle pool's measured
TTFT -- while both batch streams are still running, so it did not wait for a slot -- and the
preempted batch stream's greedy output is unchanged. Batch work is shed without headroom
(429) and never counts toward the interactive limit (max_queued_requests 1 here). Preemptions
show in splitserve_preemptions_by_class. Every decode step is slowed by an injected 20 ms hang
(the idle baseline too), a floor under a batch stream's duration, so it is surely still
running when the interactive request comes."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.cluster.frontend.priority_class import PRIORITY_CLASS_HEADER
from splitserve.cluster.routing.replica_pools import DECODE
from tests.helpers.cluster import (
    cluster_config,
    pool_states,
    serving_backend,
    slow_decode,
    wait_for_baseline,
    wait_until,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]
BATCH_TOKENS = 300
STEP_HANG_S = 0.02  # so a batch stream takes at least 6 s
# An interactive request on a full pool may take this many idle first-token times: a few
# engine steps more (the preemption, one more sequence in the batch), never a batch stream's
# remaining ~300 steps.
TTFT_BOUND_FACTOR = 5.0
BATCH = {PRIORITY_CLASS_HEADER: "batch"}


@pytest.fixture(scope="module")
def backend(ray_cluster, tiny_model, loop):
    priority = {"batch_max_running_fraction": 1.0, "batch_max_kv_usage": 1.0}
    cfg = cluster_config(tiny_model, num_prefill=0, num_blocks=64, max_queued_requests=1, priority=priority)
    cfg.decode.max_num_seqs = 2
    with serving_backend(loop, cfg, tiny_model) as serving:
        yield serving


class Stream:
    """One streamed completion in a thread: its tokens' text and when the first one came."""

    def __init__(self, base_url: str, body: dict, headers: dict):
        self.text: list[str] = []
        self.first_at = self.done_at = None
        self.started = time.monotonic()
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(base_url, body, headers), daemon=True)
        self.thread.start()

    def _run(self, base_url, body, headers):
        try:
            with httpx.stream(
                "POST", f"{base_url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=120
            ) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["text"]:
                            self.first_at = self.first_at or time.monotonic()
                            self.text.append(chunk["choices"][0]["text"])
            self.done_at = time.monotonic()
        except Exception as e:  # surfaced by the test
            self.error = e

    @property
    def ttft(self) -> float:
        return self.first_at - self.started


def body(backend, prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": backend.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}


def test_interactive_preempts_batch_work_within_the_idle_bound(http, backend, loop):
    slow_decode(loop, backend, STEP_HANG_S)  # the idle baseline runs on the same slowed steps
    try:
        run_priority_scenario(http, backend, loop)
    finally:
        slow_decode(loop, backend, 0.0)
    wait_for_baseline(loop, backend.cluster, timeout_s=30)


def run_priority_scenario(http, backend, loop):
    base = str(http.base_url)
    idle = []
    for i in range(3):
        s = Stream(base, body(backend, f"hello there {i}", 4), {})
        s.thread.join(60)
        assert s.error is None and s.first_at, s.error
        idle.append(s.ttft)
    bound = TTFT_BOUND_FACTOR * max(idle)
    preemptions_before = sum(p.engine.num_preemptions for p in pool_states(loop, backend.cluster).values())

    # Batch work needs headroom as the router sees it: wait until it sees the idle requests gone,
    # then start the batch streams one at a time.
    wait_for_baseline(loop, backend.cluster, timeout_s=30)
    router = backend.cluster.router
    wait_until(
        lambda: all(router.load(DECODE, r).effective_running == 0 for r in router.replica_ids(DECODE)),
        None,
        "the router still counts the idle requests",
    )
    batch = []
    for i in range(2):
        batch.append(Stream(base, body(backend, f"batch job {i}:", BATCH_TOKENS, ignore_eos=True), BATCH))
        wait_until(lambda: batch[-1].first_at or batch[-1].error, None, "a batch stream did not start")
        assert batch[-1].error is None, batch[-1].error
    # Both slots are batch work: more of it is shed (429), interactive work is still admitted
    # although max_queued_requests is 1: batch does not count toward it.
    shed = http.post("/v1/completions", json=body(backend, "more batch", 4), headers=BATCH)
    assert shed.status_code == 429 and "headroom" in shed.json()["error"]["message"], (
        shed.text,
        [(s.first_at, s.done_at, len(s.text)) for s in batch],
    )
    urgent = Stream(base, body(backend, "interactive now", 4), {})
    urgent.thread.join(120)
    assert urgent.error is None and urgent.first_at, urgent.error
    assert all(s.done_at is None or s.done_at > urgent.first_at for s in batch), "a batch stream ended first"
    print(f"idle TTFT max {max(idle) * 1000:.0f} ms; interactive on a full pool {urgent.ttft * 1000:.0f} ms")
    assert urgent.ttft <= bound, f"TTFT {urgent.ttft:.3f} s over {TTFT_BOUND_FACTOR}x the idle {max(idle):.3f} s"
    for s in batch:
        s.thread.join(120)
        assert s.error is None and s.done_at, s.error
    after = sum(p.engine.num_preemptions for p in pool_states(loop, backend.cluster).values())
    assert after > preemptions_before
    slow_decode(loop, backend, 0.0)  # the floor's work is done: the reference runs go at full speed
    for i, s in enumerate(batch):  # alone, nothing else running: the same greedy text
        alone = http.post("/v1/completions", json=body(backend, f"batch job {i}:", BATCH_TOKENS, ignore_eos=True))
        assert alone.status_code == 200 and alone.json()["choices"][0]["text"] == "".join(s.text)
    wait_for_baseline(loop, backend.cluster, timeout_s=30)

    def preempted(klass: str) -> float:
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for sample in family.samples:
                if sample.name == "splitserve_preemptions_by_class_total" and sample.labels["class"] == klass:
                    return sample.value
        return 0.0

    wait_until(lambda: preempted("batch") > 0, None, "no batch preemption in splitserve_preemptions_by_class")
    assert preempted("interactive") == 0
