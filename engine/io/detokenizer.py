"""Turn generated token ids into text deltas for streaming, one token at a time."""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context so decoders that strip a leading space (Metaspace)
# still produce the space between the prompt and the first generated word.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streams the decoded text of a growing list of output tokens.

    Each step decodes a small window twice (with and without the new tokens) and emits the
    difference, the same offset scheme vLLM and HF's TextStreamer use. A window whose text
    ends in U+FFFD is held back: it is usually a multi-byte UTF-8 character split across
    tokens, which the next token completes.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids or [])[-PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""  # appended to, never rebuilt: a join per token made a request O(n^2)

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """All text emitted so far (excludes a held-back incomplete character)."""
        return self._text

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; returns the newly completed text (possibly "")."""
        self._ids.append(int(token_id))
        return self._emit(hold_partial=True)

    def add_tokens(self, token_ids: list[int]) -> str:
        return "".join(self.add_token(t) for t in token_ids)

    def flush(self) -> str:
        """At the end of a request: emit held-back text (an incomplete character decodes
        to U+FFFD, exactly as a full decode of the output shows it)."""
        return self._emit(hold_partial=False)

    def _emit(self, hold_partial: bool) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text):
            return ""
        if hold_partial and new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta
