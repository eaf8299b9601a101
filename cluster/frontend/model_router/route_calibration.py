"""What `splitserve calibrate-route` measures, and how it picks a cascade's threshold.

A prompt's confidence is the cascade's own (cluster/frontend/model_router/cascade_binding.py):
exp(mean log-probability) of the small model's first window_tokens greedy tokens, from the
colocated engine running the same checkpoint. Quality is the large model's mean per-token
log-likelihood of an answer (its own greedy answer for always-large), from its prompt
log-probabilities over prompt + answer. The threshold for a target share of large-model calls
is RouteLLM's calibration: the confidence quantile below which that share of the reference
prompts falls.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from splitserve.cluster.frontend.model_router.cascade_binding import confidence_of
from splitserve.engine.builtin_models.corpus import PASSAGES
from splitserve.proto.messages.sampling_params import SamplingParams

PROMPT_WORDS = 12


@dataclass
class PromptMeasure:
    prompt: str
    kind: str  # "easy" (in the small model's training text), "hard" (out of it), or "given"
    confidence: float  # the small model's, over the window
    small_answer: list[int]
    large_answer: list[int]
    small_quality: float | None = None  # the large model's mean log-likelihood per token of the small answer
    large_quality: float | None = None  # ...of its own answer


def reference_prompts(num_easy: int, num_hard: int, seed: int = 0, easy_offset: int = 0) -> list[tuple[str, str]]:
    """(kind, text): `easy` prompts are PROMPT_WORDS words of a corpus passage (the built-in
    models are trained on them), starting easy_offset words in, then every 3 * PROMPT_WORDS
    words (passage after passage); `hard` ones are corpus words in a shuffled order, which no
    training text contains."""
    rng = random.Random(seed)
    words = [w for passage in PASSAGES for w in passage.split()]
    easy = []
    for i in range(num_easy):
        passage = PASSAGES[i % len(PASSAGES)].split()
        start = (easy_offset + (i // len(PASSAGES)) * 3 * PROMPT_WORDS) % max(1, len(passage) - PROMPT_WORDS)
        easy.append(("easy", " ".join(passage[start : start + PROMPT_WORDS])))
    hard = [("hard", " ".join(rng.sample(words, PROMPT_WORDS))) for _ in range(num_hard)]
    return easy + hard


def measure(small, large, prompts: list[tuple[str, str]], window_tokens: int, max_tokens: int) -> list[PromptMeasure]:
    """Every prompt through the small model (confidence, greedy answer) and, when large is an
    engine, the large model (its greedy answer, and its log-likelihood of both answers)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=True)
    texts = [text for _, text in prompts]
    small_out = small.generate(texts, greedy)
    large_out = large.generate(texts, greedy) if large is not None else [None] * len(texts)
    measures = [
        PromptMeasure(
            text, kind, confidence_of(s.logprobs, window_tokens), list(s.token_ids), list(l.token_ids) if l else []
        )
        for (kind, text), s, l in zip(prompts, small_out, large_out)
    ]
    if large is not None:
        prompt_ids = [large.tokenizer.encode(text) for text in texts]
        for m, ids, own in zip(measures, prompt_ids, large_out):
            m.small_quality = log_likelihood(large, ids, m.small_answer)
            m.large_quality = sum(own.logprobs) / max(1, len(own.logprobs))
    return measures


def log_likelihood(engine, prompt_ids: list[int], answer: list[int]) -> float:
    """The engine's mean log-probability per token of answer after prompt_ids."""
    if not answer:
        return 0.0
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    out = engine.generate([prompt_ids + answer], params)[0]
    # prompt_logprobs[i] is token i + 1's log-probability given the tokens before it.
    scores = out.prompt_logprobs[len(prompt_ids) - 1 :]
    return sum(scores) / len(scores)


def pick_threshold(confidences: list[float], large_share: float) -> float:
    """The threshold under which round(large_share * N) of the confidences fall: the midpoint
    between the last escalated and the first kept one (0: none escalate; above the largest: all)."""
    if not 0 <= large_share <= 1:
        raise ValueError(f"the large-model share must be in [0, 1], got {large_share}")
    ranked = sorted(confidences)
    k = round(large_share * len(ranked))
    if k == 0:
        return 0.0
    if k == len(ranked):
        return min(1.0, math.nextafter(ranked[-1], math.inf))
    return (ranked[k - 1] + ranked[k]) / 2


def route_snippet(name: str, small: str, large: str, window_tokens: int, thresholds: dict[float, float]) -> str:
    """A ServeConfig YAML snippet: the cascade route at the first share's threshold, the others
    as comments."""
    (first_share, first), *others = thresholds.items()
    lines = [
        f"# splitserve calibrate-route: threshold for a {first_share:.0%} share of large-model calls",
        *(f"#   {share:.0%} large: threshold {value:.6f}" for share, value in others),
        "model_routes:",
        f"  - name: {name}",
        "    policy: cascade",
        "    cascade:",
        f"      small: {small}",
        f"      large: {large}",
        f"      window_tokens: {window_tokens}",
        f"      threshold: {first:.6f}",
    ]
    return "\n".join(lines) + "\n"
