"""Weight quantization of the experts (int8, fp8, int4, as they load): every expert's matmuls
quantized, the router kept exact, and a trained mixture of experts stays within the perplexity
tolerances of bench/results/quantization.md (int8 and fp8 <= 1%, int4 <= 5%, on training text,
where the model is confident) and close to full precision's greedy choices; with the experts'
scales collapsed to one per matrix (a broken quantization) it falls below that bar.

The model: the trained default model (cached; trained on first use) upcycled into a Mixtral
(tests/helpers/upcycled_moe.py). Agreement is teacher-forced, as in test_quantization_quality.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.cluster.default_model import DEFAULT_SPEC
from splitserve.engine.builtin_models.corpus import PASSAGES
from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.model.loader import load_model
from splitserve.engine.quant.quantize import WEIGHT_CLASSES, weight_bytes
from tests.helpers.model import READS_TRAINED_CHECKPOINT, greedy_generate
from tests.helpers.quantization_quality import PROMPTS, agreement, collapse_scales, logits
from tests.helpers.upcycled_moe import upcycle_to_mixtral

# Training the default model on a machine without the cache takes minutes (see
# test_quantization_quality.py): a generous safety net for that.
pytestmark = [pytest.mark.timeout(1200), pytest.mark.usefixtures("one_torch_thread"), READS_TRAINED_CHECKPOINT]
NEW_TOKENS = 24
PERPLEXITY_TOLERANCE = {"int8": 0.01, "fp8": 0.01, "int4": 0.05}  # bench/results/quantization.md's
# Teacher-forced top-1 agreement over 144 positions. Deterministic on one CPU with one thread,
# but not across CPUs: the trained checkpoint itself differs with the machine's kernels. Measured
# on an AMD EPYC: int8 0.986, fp8 0.938, int4 0.847, and with the experts' scales collapsed 0.882,
# 0.868, 0.819; on an Intel Xeon: 0.986, 0.965, 0.889, collapsed 0.903, 0.896, 0.847. So one
# machine's broken int4 agrees as well as another's correct one: the broken quantization is told
# apart by what it loses against the correct one on the same machine (EPYC 15, 10 and 4 positions;
# Xeon 12, 10 and 6), not by an absolute bar.
REQUIRED_AGREEMENT = {"int8": 0.95, "fp8": 0.9, "int4": 0.83}
BROKEN_LOSES_AT_LEAST = {"int8": 8 / 144, "fp8": 6 / 144, "int4": 3 / 144}


@pytest.fixture(scope="module")
def upcycled(tmp_path_factory):
    """(model dir, prompt + full-precision greedy continuations, prompt lengths, training-text
    ids, full precision's perplexity on them)."""
    dense = cached_checkpoint(DEFAULT_SPEC).path
    path = upcycle_to_mixtral(dense, tmp_path_factory.mktemp("upcycled-mixtral"))
    tokenizer = Tokenizer.from_pretrained(path)
    full, config = load_model(path)
    assert config.num_experts == 4 and config.moe_layers == list(range(config.num_hidden_layers))
    sequences, prompt_lens = [], []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        sequences.append(ids + greedy_generate(full, ids, NEW_TOKENS))
        prompt_lens.append(len(ids))
    texts = [tokenizer.encode(passage[:600]) for passage in PASSAGES[:6]]  # the bench's training text
    return path, sequences, prompt_lens, texts, _perplexity(full, texts)


def _perplexity(model, texts: list[list[int]]) -> float:
    nll = count = 0.0
    for ids in texts:
        logprobs = logits(model, ids)[:-1].log_softmax(-1)
        nll -= float(logprobs.gather(1, torch.tensor(ids[1:])[:, None]).sum())
        count += len(ids) - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_quantized_experts_stay_within_the_perplexity_tolerance_and_a_broken_one_does_not(upcycled, scheme):
    path, sequences, prompt_lens, texts, full_perplexity = upcycled
    model, _ = load_model(path, quantization=scheme)
    experts = [expert for layer in model.layers for expert in layer.moe.experts]
    assert all(isinstance(getattr(e, n), WEIGHT_CLASSES[scheme]) for e in experts for n in e.MATMUL_WEIGHTS)
    assert all(isinstance(layer.moe.router_weight, torch.Tensor) for layer in model.layers)  # routing exact
    float32_bytes = sum(4 * 3 * m.inter * m.hidden * m.num_experts for m in (layer.moe for layer in model.layers))
    assert sum(weight_bytes(e) for e in experts) < float32_bytes / 3  # 4-byte weights: 1 or 1/2 byte each now
    change = _perplexity(model, texts) / full_perplexity - 1
    assert change <= PERPLEXITY_TOLERANCE[scheme], (scheme, change)
    agreed = agreement(model, sequences, prompt_lens)
    assert agreed >= REQUIRED_AGREEMENT[scheme], (scheme, agreed)
    collapse_scales(getattr(e, n) for e in experts for n in e.MATMUL_WEIGHTS)  # the experts' only
    broken = agreement(model, sequences, prompt_lens)
    assert agreed - broken >= BROKEN_LOSES_AT_LEAST[scheme], (scheme, agreed, broken)
