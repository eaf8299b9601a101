"""Continuation: what a migrated request's new replica is told about the answer so far. When a
stream's decode replica fails, the ingress re-submits the request with the prompt followed by
every token the client already has; this small frozen Struct (inside SamplingParams, set only by
the ingress) says how many of the prompt's last tokens are that output and how many characters
of its text the client was sent, so the new replica samples, penalizes, constrains and
detokenizes as the first one would have gone on doing."""

from __future__ import annotations

import msgspec

from splitserve.proto.messages.invalid_request import InvalidRequestError


class Continuation(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_output_tokens: int  # the prompt's last this many tokens are output the client has
    num_text_chars: int  # characters of that output's text already sent (the rest was held back)

    def __post_init__(self) -> None:
        if not isinstance(self.num_output_tokens, int) or self.num_output_tokens < 1:
            raise InvalidRequestError(f"a continuation resumes at least one token, got {self.num_output_tokens!r}")
        if not isinstance(self.num_text_chars, int) or self.num_text_chars < 0:
            raise InvalidRequestError(f"a continuation's sent text is >= 0 characters, got {self.num_text_chars!r}")
