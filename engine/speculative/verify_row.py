"""VerifyRow: one logits row of a speculative verify step, seen as the sequence it would be
if the draft tokens before it were accepted.

Row j of a sequence's verify rows predicts output position num_output_tokens + j, after the
draft's first j tokens. Logits processing (min_tokens, penalties) and seeded sampling read a
sequence's params, output tokens and output count; this view answers them for that position,
so every verify row is processed and sampled exactly as the plain step at that position
would be -- which is what makes seeded requests reproducible under speculation. Torch-free.
"""

from __future__ import annotations

from splitserve.engine.core.sequence import Sequence


class VerifyRow:
    __slots__ = ("seq", "draft_prefix")

    def __init__(self, seq: Sequence, draft_prefix: list[int]):
        self.seq = seq
        self.draft_prefix = draft_prefix  # the draft tokens before this row's position

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def params(self):
        return self.seq.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.draft_prefix if self.draft_prefix else self.seq.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.draft_prefix)
