"""Detokenizes generated tokens incrementally and enforces stop strings.

Streaming text holds back a tail that could still grow into a stop string, so a client never
sees the beginning of a stop string that later gets cut.
"""

from __future__ import annotations

from splitserve.engine.core.sequence import Sequence
from splitserve.engine.io.detokenizer import IncrementalDetokenizer
from splitserve.engine.io.request_output import RequestOutput
from splitserve.engine.io.tokenizer import Tokenizer


def _held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class _RequestState:
    __slots__ = ("detok", "num_tokens_seen", "num_chars_sent", "num_logprobs_seen", "stopped_text")

    def __init__(self, detok: IncrementalDetokenizer):
        self.detok = detok
        self.num_tokens_seen = 0
        self.num_chars_sent = 0
        self.num_logprobs_seen = 0
        self.stopped_text: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def process(self, seq: Sequence) -> tuple[RequestOutput, bool]:
        """Build the output for seq's new tokens. Returns (output, hit_stop_string)."""
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = _RequestState(IncrementalDetokenizer(self.tokenizer))
        outputs = seq.output_token_ids
        new_ids = outputs[state.num_tokens_seen :]
        hit_stop = False
        stops = seq.params.stop
        for tok in new_ids:
            if state.stopped_text is not None:
                break
            state.detok.add_token(tok)
            if stops:
                text = state.detok.text
                window_start = max(0, len(text) - max(len(s) for s in stops) - 8)
                for stop in stops:
                    pos = text.find(stop, window_start)
                    if pos >= 0:
                        end = pos + len(stop) if seq.params.include_stop_str_in_output else pos
                        state.stopped_text = text[:end]
                        hit_stop = True
                        break
        state.num_tokens_seen = len(outputs)
        finished = seq.is_finished or hit_stop
        if finished and state.stopped_text is None:
            state.detok.flush()  # an output ending mid-character shows U+FFFD, like a full decode
        full_text = state.stopped_text if state.stopped_text is not None else state.detok.text
        visible = len(full_text)
        if not finished and stops:
            visible -= _held_back(full_text, stops)
        visible = max(visible, state.num_chars_sent)
        new_text = full_text[state.num_chars_sent : visible]
        state.num_chars_sent = visible
        new_logprobs = seq.output_logprobs[state.num_logprobs_seen :]
        state.num_logprobs_seen = len(seq.output_logprobs)
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=list(new_ids),
            new_text=new_text,
            token_ids=list(outputs),
            text=full_text[:visible],
            finished=finished,
            finish_reason="stop" if hit_stop else seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=list(new_logprobs),
            logprobs=list(seq.output_logprobs),
        )
        if finished:
            self._states.pop(seq.request_id, None)
        return out, hit_stop

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
