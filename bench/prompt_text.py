"""PromptTextRenderer: token-id prompts as text, for servers or endpoints that need text.

With a tokenizer (a tokenizer.json file, or a directory holding one) the ids are decoded by it, so
the server re-tokenizes to about the same ids. Without one each id becomes a fixed pseudo-word;
either way equal id prefixes give equal text prefixes, which keeps prefix sharing intact.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")


def token_id_to_word(token_id: int) -> str:
    """Base-70 syllable spelling of the id: distinct ids give distinct words."""
    if token_id < 0:
        raise ValueError(f"token ids must be >= 0, got {token_id}")
    syllables = []
    value = token_id
    while True:
        value, digit = divmod(value, len(_SYLLABLES))
        syllables.append(_SYLLABLES[digit])
        if value == 0:
            return "".join(reversed(syllables))


class PromptTextRenderer:
    def __init__(self, tokenizer_path: str | Path | None = None) -> None:
        self._tokenizer = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer  # only needed when a tokenizer is given

            path = Path(tokenizer_path)
            if path.is_dir():
                path = path / "tokenizer.json"
            if not path.is_file():
                raise FileNotFoundError(f"no tokenizer.json at {tokenizer_path}")
            self._tokenizer = Tokenizer.from_file(str(path))

    def render(self, token_ids: Sequence[int]) -> str:
        if self._tokenizer is not None:
            return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)
        return " ".join(token_id_to_word(token_id) for token_id in token_ids)
