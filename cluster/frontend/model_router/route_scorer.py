"""RouteScorer: the pluggable interface of the `scorer` policy, and load_scorer (by import path).

A scorer says how much a request needs the large model, in [0, 1]; the route sends requests
scored at or above its threshold to the large model. A RouteLLM-style trained classifier is a
subclass taking its options (e.g. a weights file) as constructor keywords:

    model_routes:
      - name: auto
        policy: scorer
        scorer: {scorer: "mypkg.router:BertScorer", options: {weights: /models/router.pt}, ...}
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

from splitserve.cluster.frontend.model_router.request_features import RequestFeatures


class RouteScorer(ABC):
    @abstractmethod
    def score(self, features: RequestFeatures, text: str) -> float:
        """How much the request needs the large model, in [0, 1]; text: the prompt decoded."""


def load_scorer(path: str, options: dict[str, Any]) -> RouteScorer:
    """The built-in `length` scorer, or the RouteScorer class at `package.module:Class`,
    built with options as keywords; ValueError naming the path when it cannot be."""
    if path == "length":
        from splitserve.cluster.frontend.model_router.length_scorer import LengthScorer

        cls: Any = LengthScorer
    else:
        module_name, _, class_name = path.partition(":")
        if not module_name or not class_name:
            raise ValueError(f"scorer {path!r}: expected `length` or an import path `package.module:Class`")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"scorer {path!r} cannot be imported: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, RouteScorer)):
            raise ValueError(f"scorer {path!r} is not a RouteScorer subclass")
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(f"scorer {path!r}: bad options {sorted(options)}: {exc}") from None
