"""The quote workload: prompts whose continuation repeats text they contain, where n-gram
(prompt lookup) speculation has something to find.

Each prompt is `<s>` + `quote_len` tokens of a built-in corpus passage + "\\n\\n" + the quote's
first `cue_len` tokens again -- the `quote` prompts of bench/models/trained_model.py, on which the
trained checkpoints (make-model --train-steps) continue by repeating the quote. The passage
and the quote's offset vary per request (seeded). Needs the served model's tokenizer (the
corpus tokenizer of make-model checkpoints): `splitserve bench --workload quote --tokenizer DIR`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.bench.loadgen.records import BenchRequest, WorkloadError

SEPARATOR = "\n\n"


@dataclass(frozen=True)
class QuoteWorkload:
    tokenizer: str  # tokenizer.json, or the checkpoint directory holding it
    num_requests: int = 16
    quote_len: int = 64
    cue_len: int = 4
    max_tokens: int = 128
    kind: str = dataclasses.field(default="quote", init=False)

    def __post_init__(self) -> None:
        for name in ("num_requests", "quote_len", "cue_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise WorkloadError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cue_len > self.quote_len:
            raise WorkloadError(f"cue_len ({self.cue_len}) must be <= quote_len ({self.quote_len})")

    def generate(self, seed: int) -> list[BenchRequest]:
        from tokenizers import Tokenizer

        from splitserve.engine.builtin_models.corpus import PASSAGES
        from splitserve.engine.builtin_models.corpus_tokenizer import BOS_TOKEN

        path = Path(self.tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise WorkloadError(f"--workload quote needs --tokenizer (a tokenizer.json or its directory), got {path}")
        tok = Tokenizer.from_file(str(path))
        bos = tok.token_to_id(BOS_TOKEN)
        if bos is None:
            raise WorkloadError(f"{path} has no {BOS_TOKEN} token: the quote workload needs a make-model tokenizer")
        separator = tok.encode(SEPARATOR, add_special_tokens=False).ids
        passages = [ids for p in PASSAGES if len(ids := tok.encode(p, add_special_tokens=False).ids) >= self.quote_len]
        if not passages:
            raise WorkloadError(f"no corpus passage has {self.quote_len} tokens")
        rng = np.random.default_rng(seed)
        requests = []
        for i in range(self.num_requests):
            ids = passages[int(rng.integers(len(passages)))]
            start = int(rng.integers(len(ids) - self.quote_len + 1))
            quote = ids[start : start + self.quote_len]
            requests.append(
                BenchRequest(
                    request_id=f"quote{i}",
                    prompt_token_ids=tuple([bos, *quote, *separator, *quote[: self.cue_len]]),
                    max_tokens=self.max_tokens,
                    group_id="quote",
                )
            )
        return requests

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}
