"""The architectures disaggregated, over HTTP: Qwen3, Gemma 3 (sliding and global layers, both
kinds through the KV transfer), Phi-3 and Mixtral (every layer windowed: the transfer moves only
the prompt blocks its window still sees), transformers-written checkpoints served side by side
in one deployment (local Ray, CPU; each model a prefill and a decode replica, every prompt
prefilled remotely and its KV sent over). Each model's greedy output through the `openai` client
equals transformers' own generate on prompts shorter and longer than the windows, and every
pool returns to baseline. One deployment for all four: the serial group's time is a budget."""

from __future__ import annotations

import openai
import pytest
import ray
import torch
import transformers

from splitserve.proto.messages.poll_reply import PollReply
from tests.helpers.cluster import cluster_config
from tests.helpers.models_deployment import ModelsDeployment
from tests.helpers.transformers_checkpoint import (
    SERVABLE_SHAPE,
    TOKENIZER_VOCAB,
    hf_greedy,
    write_transformers_checkpoint,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]
TIMEOUT_S = 120
WINDOW = 24
SHAPE = SERVABLE_SHAPE
CONFIGS = {
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=True),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3},
        head_dim=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW,
        query_pre_attn_scalar=16,
        final_logit_softcapping=5.0,
    ),
    "phi3": lambda: transformers.Phi3Config(**{**SHAPE, "hidden_size": 128}, rope_scaling=None),
    "mixtral": lambda: transformers.MixtralConfig(
        **SHAPE, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW
    ),
}
PROMPT_LENGTHS = (9, 3 * WINDOW - 2)  # inside every window; three windows long
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory, loop):
    """The deployment, and per model: transformers' model (the reference)."""
    references, entries = {}, []
    for name, make in CONFIGS.items():
        path = tmp_path_factory.mktemp(name)
        references[name] = write_transformers_checkpoint(make(), path, seed=len(name), tokenizer=True)
        entries.append({"model": str(path), "served_model_name": name})
    cfg = cluster_config(entries[0]["model"], policy="kv", num_blocks=64, models=entries)
    deployment = ModelsDeployment(loop, cfg)
    try:
        yield deployment, references
    finally:
        deployment.close()


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, TOKENIZER_VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _received_blocks(deployment: ModelsDeployment, name: str) -> int:
    """KV blocks the model's decode replicas have received, all transfers so far."""
    total = 0
    for replica in deployment.pools(name)["decode"].live_replicas():
        total += PollReply.from_bytes(ray.get(replica.handle.poll.remote(), timeout=30)).transfer.num_blocks
    return total


def test_each_architecture_disaggregated_gives_transformers_greedy_tokens(served):
    deployment, references = served
    client = openai.OpenAI(base_url=deployment.http.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    for index, (name, hf) in enumerate(references.items()):
        tokenizer = deployment.backends[name].tokenizer
        for length in PROMPT_LENGTHS:
            prompt = _prompt(length, seed=10 * index + length)
            before = _received_blocks(deployment, name)
            answer = client.completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert answer.choices[0].text == tokenizer.decode(hf_greedy(hf, prompt, MAX_TOKENS)), (name, length)
            received = _received_blocks(deployment, name) - before
            num_blocks = -(-length // 16)
            # Mixtral: every layer windowed, so only the blocks its next query's window reaches.
            skipped = max(length - WINDOW + 1, 0) // 16 if name == "mixtral" else 0
            assert received == num_blocks - skipped, (name, length, received)
    deployment.baseline()
