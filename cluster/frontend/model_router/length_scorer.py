"""LengthScorer: the built-in RouteScorer, a heuristic: long prompts, long answers and prompts
with words that ask for reasoning or code are the large model's work."""

from __future__ import annotations

from splitserve.cluster.frontend.model_router.request_features import RequestFeatures
from splitserve.cluster.frontend.model_router.route_scorer import RouteScorer

DEFAULT_KEYWORDS = ("prove", "derive", "step by step", "explain why", "analyze", "code", "function", "translate")


class LengthScorer(RouteScorer):
    def __init__(
        self,
        long_prompt_tokens: float = 512,
        long_answer_tokens: float = 512,
        keywords: list[str] | tuple[str, ...] = DEFAULT_KEYWORDS,
        keyword_weight: float = 0.5,
    ):
        if not long_prompt_tokens > 0 or not long_answer_tokens > 0:
            raise ValueError("long_prompt_tokens and long_answer_tokens must be > 0")
        if not 0 <= keyword_weight <= 1:
            raise ValueError("keyword_weight must be in [0, 1]")
        self.long_prompt_tokens = long_prompt_tokens
        self.long_answer_tokens = long_answer_tokens
        self.keywords = tuple(k.lower() for k in keywords)
        self.keyword_weight = keyword_weight

    def score(self, features: RequestFeatures, text: str) -> float:
        # Length: the larger of the prompt's and the answer's share of "long", capped at 1.
        length = max(
            features.prompt_tokens / self.long_prompt_tokens, features.params.max_tokens / self.long_answer_tokens
        )
        lowered = text.lower()
        keyword = any(k in lowered for k in self.keywords)
        return min(1.0, (1 - self.keyword_weight) * min(1.0, length) + self.keyword_weight * keyword)
