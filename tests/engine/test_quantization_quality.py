"""Quantized greedy decoding stays close to full precision on a trained model, and a broken
quantization (per-channel scales collapsed to one per matrix) falls below the same bar.

The model is the cached trained `small` preset (the default model `splitserve serve` uses;
made once per machine in $SPLITSERVE_CACHE). Agreement is teacher-forced: the full-precision
model's own greedy continuations are fed to each model and its argmax compared at every
position, so one early divergence does not decide the score (free-running greedy agreement is
also checked, for int8, which tracks full precision closely enough to stay on its path).
"""

from __future__ import annotations

import pytest

from splitserve.cluster.default_model import DEFAULT_SPEC
from splitserve.engine.builtin_models.model_cache import cached_checkpoint
from splitserve.engine.io.tokenizer import Tokenizer
from splitserve.engine.model.loader import load_model
from tests.helpers.model import READS_TRAINED_CHECKPOINT, greedy_generate
from tests.helpers.quantization_quality import PROMPTS, agreement, collapse_scales

# On a machine without the cache, the fixture first trains the default model (about 100 s of CPU
# on 2 quiet cores, 11 min measured on a heavily shared box): a generous safety net for that.
pytestmark = [pytest.mark.timeout(1200), pytest.mark.usefixtures("one_torch_thread"), READS_TRAINED_CHECKPOINT]
NEW_TOKENS = 24
# Teacher-forced top-1 agreement each scheme must reach over 144 positions (measured: int8 0.986,
# fp8 0.944, int4 0.854; with the scales collapsed to one per matrix: 0.792, 0.743, 0.743, on an AMD
# EPYC; on an Intel Xeon, whose kernels train a slightly different checkpoint: 0.993, 0.965, 0.903,
# collapsed 0.743, 0.729, 0.729). The arithmetic is deterministic on one CPU (one thread), so the
# margins do not depend on load.
REQUIRED_AGREEMENT = {"int8": 0.95, "fp8": 0.9, "int4": 0.8}


@pytest.fixture(scope="module")
def trained():
    """(model dir, [prompt + full-precision greedy continuation ids], their prompt lengths)."""
    path = cached_checkpoint(DEFAULT_SPEC).path
    tokenizer = Tokenizer.from_pretrained(path)
    full, _ = load_model(path)
    sequences, prompt_lens = [], []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        sequences.append(ids + greedy_generate(full, ids, NEW_TOKENS))
        prompt_lens.append(len(ids))
    return path, sequences, prompt_lens


@pytest.mark.parametrize("scheme", ["int8", "fp8", "int4"])
def test_quantized_model_agrees_with_full_precision_and_a_broken_one_does_not(trained, scheme):
    path, sequences, prompt_lens = trained
    model, _ = load_model(path, quantization=scheme)
    agreed = agreement(model, sequences, prompt_lens)
    assert agreed >= REQUIRED_AGREEMENT[scheme], (scheme, agreed)
    collapse_scales(getattr(layer, attr) for layer in model.layers for attr in layer.LINEAR_WEIGHTS)
    broken = agreement(model, sequences, prompt_lens)
    assert broken < REQUIRED_AGREEMENT[scheme], (scheme, broken)


def test_int8_free_running_greedy_output_mostly_matches(trained):
    path, sequences, prompt_lens = trained
    model, _ = load_model(path, quantization="int8")
    matched = 0
    for ids, start in zip(sequences, prompt_lens):
        out = greedy_generate(model, ids[:start], NEW_TOKENS)
        matched += next((i for i, (a, b) in enumerate(zip(out, ids[start:])) if a != b), NEW_TOKENS)
    assert matched / (NEW_TOKENS * len(PROMPTS)) >= 0.75  # measured 0.90 (one prompt diverges late)
