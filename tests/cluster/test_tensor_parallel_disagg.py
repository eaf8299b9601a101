"""Prefill and decode pools of different tensor-parallel sizes, served (real Ray actors, gloo on
CPU, the OpenAI SDK over HTTP): one deployment serving the tiny model three times, as P/D TP
2/1, 1/2 and 2/2 (each a model of its own, with its own prefill and decode gangs), so one start
covers the three. For each: greedy text equals the TP-1 engine's, token log-probabilities
within LOGPROB_TOL (a TP-2 replica's sums reduce in another order); the bytes each request
moves -- counted by the replicas' transports, not timed -- are the 1/1 figure (its blocks times
the whole model's bytes per block); a decode-side prefix hit moves only the missing blocks;
and every pool returns to baseline. The transfer's rank-to-rank details (replicated KV heads,
int8 scales, each decode rank's heads) are checked without Ray in tests/kvtransfer/."""

from __future__ import annotations

import uuid

import openai
import pytest
import ray

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.model_controllers import ModelControllers, hash_seed_of
from splitserve.cluster.frontend.backend import ServingBackend
from splitserve.cluster.frontend.http.api import build_http_app
from splitserve.cluster.frontend.model_catalog import ModelCatalog
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_sizing import kv_bytes_per_block
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.model_config import ModelConfig
from splitserve.proto.messages.poll_reply import PollReply
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.cluster import LoopHttpServer, wait_until

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
TIMEOUT_S = 120
LOGPROB_TOL = 1e-4  # fp32, as tests/engine/test_tensor_parallel.py
SIZES = {"tp-2-1": (2, 1), "tp-1-2": (1, 2), "tp-2-2": (2, 2)}  # served name -> (prefill, decode) TP
BLOCK_SIZE = 16


class Deployment:
    """The three models' controllers, their backends and the HTTP app in front of them."""

    def __init__(self, loop, cfg):
        self.loop = loop
        self.controllers = ModelControllers(cfg, f"test-{uuid.uuid4().hex[:8]}", autoscale=False)
        loop.run(self.controllers.start(), timeout=360)
        self.backends = {}
        first = None
        for name, one in cfg.model_deployments():
            self.backends[name] = first = ServingBackend(
                one,
                one.model,
                controller=self.controllers.client(name),
                share_with=first,
                hash_seed=hash_seed_of(cfg, name),
            )
            loop.run(first.start(), timeout=TIMEOUT_S)
        catalog = ModelCatalog.of(*self.backends.values())
        self.http = LoopHttpServer(loop, build_http_app(first, catalog=catalog)).__enter__()

    def replicas(self, name: str):
        return [r for pool in self.controllers.controllers[name].pools.values() for r in pool.live_replicas()]

    def states(self, name: str) -> dict[str, PollReply]:
        return {r.pool: PollReply.from_bytes(ray.get(r.handle.poll.remote(), timeout=30)) for r in self.replicas(name)}

    def close(self) -> None:
        self.http.__exit__(None, None, None)
        for backend in self.backends.values():
            self.loop.run(backend.shutdown(), timeout=60)
        self.loop.run(self.controllers.shutdown(), timeout=120)


@pytest.fixture(scope="module")
def deployment(ray_cluster, tiny_model, loop):
    pool = {"replicas": 1, "num_kv_blocks": 64, "resources": {"num_cpus": 0.5}, "torch_threads": 1}  # 10 rank actors
    cfg = ServeConfig.model_validate(
        {
            "model": tiny_model,
            "block_size": BLOCK_SIZE,
            "prefill": pool,
            "decode": pool,
            "router": {"policy": "round-robin", "local_prefill_threshold": 0},
            "models": [
                {
                    "served_model_name": name,
                    "prefill": {"tensor_parallel_size": p},
                    "decode": {"tensor_parallel_size": d},
                }
                for name, (p, d) in SIZES.items()
            ],
        }
    )
    made = Deployment(loop, cfg)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(scope="module")
def client(deployment):
    return openai.OpenAI(base_url=deployment.http.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def offline(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, num_kv_blocks=64, block_size=BLOCK_SIZE))


def _greedy(offline: LLMEngine, prompt: list[int]):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    return offline.generate([prompt], params)[0]


def _served(client, name: str, prompt: list[int]):
    answer = client.completions.create(
        model=name, prompt=prompt, max_tokens=8, temperature=0, logprobs=1, extra_body={"ignore_eos": True}
    )
    return answer.choices[0]


def _moved(deployment, name: str, before: dict[str, PollReply]) -> tuple[int, int, int]:
    """(blocks decode received, bytes decode received, bytes prefill sent) since `before`."""
    after = deployment.states(name)
    sent = after["prefill"].transfer.num_bytes - before["prefill"].transfer.num_bytes
    decode, was = after["decode"].transfer, before["decode"].transfer
    return decode.num_blocks - was.num_blocks, decode.num_bytes - was.num_bytes, sent


def test_greedy_text_and_logprobs_equal_tp1_and_each_request_moves_the_1_1_bytes(
    deployment, client, offline, tiny_model
):
    per_block = kv_bytes_per_block(ModelConfig.from_pretrained(tiny_model), BLOCK_SIZE, "auto", None)
    for index, name in enumerate(SIZES):
        prompt = [100 + index] + list(range(20, 59))  # 40 tokens, 3 blocks; a first block of its own
        expected = _greedy(offline, prompt)
        before = deployment.states(name)
        choice = _served(client, name, prompt)
        assert choice.text == expected.text, name
        served_logprobs = choice.logprobs.token_logprobs
        assert len(served_logprobs) == len(expected.logprobs)
        assert max(abs(a - b) for a, b in zip(served_logprobs, expected.logprobs)) <= LOGPROB_TOL, name
        blocks, received, sent = _moved(deployment, name, before)
        assert blocks == 3 and received == sent == 3 * per_block, (name, blocks, received, sent)


def test_a_decode_side_prefix_hit_moves_only_the_missing_blocks(deployment, client, offline, tiny_model):
    per_block = kv_bytes_per_block(ModelConfig.from_pretrained(tiny_model), BLOCK_SIZE, "auto", None)
    for index, name in enumerate(("tp-2-1", "tp-1-2")):
        head = [200 + index] + list(range(60, 91))  # 32 tokens: 2 whole blocks
        assert _served(client, name, head).text == _greedy(offline, head).text
        prompt = head + list(range(300, 320))  # 52 tokens: 4 blocks, the first 2 cached on decode
        before = deployment.states(name)
        assert _served(client, name, prompt).text == _greedy(offline, prompt).text, name
        blocks, received, sent = _moved(deployment, name, before)
        assert blocks == 2 and received == sent == 2 * per_block, (name, blocks, received, sent)


def test_every_pool_returns_to_baseline(deployment):
    def idle() -> bool:
        for name in SIZES:
            for state in deployment.states(name).values():
                e = state.engine
                if e.num_free_blocks != e.num_blocks or state.num_pinned or e.num_running or e.num_waiting:
                    return False
        return True

    wait_until(idle, None, "block pools not back to baseline", interval_s=0.2)
    for name, (prefill, decode) in SIZES.items():
        gangs = {r.pool: r.gang for r in deployment.replicas(name)}
        assert (gangs["prefill"].size if gangs["prefill"] else 1, gangs["decode"].size if gangs["decode"] else 1) == (
            prefill,
            decode,
        )
