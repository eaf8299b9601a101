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


def _find_stop(text: str, num_chars_before: int, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string ending after text[:num_chars_before]: (position, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, max(0, num_chars_before - len(stop) + 1))
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, stop)
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
            state = self._states[seq.request_id] = self._new_state(seq)
        params = seq.params
        outputs = seq.output_token_ids
        new_ids = outputs[state.num_tokens_seen :]
        # Like vLLM, the text of the EOS / stop token that ended the request is left out.
        skip_last = seq.is_finished and seq.stopped_by_token and not params.include_stop_str_in_output
        hit_stop = False
        stops = params.stop
        for i, tok in enumerate(new_ids):
            if state.stopped_text is not None or (skip_last and i == len(new_ids) - 1):
                break
            num_chars_before = len(state.detok.text)
            state.detok.add_token(tok)
            # Stop strings count only once min_tokens are out (vLLM), and only where they end
            # in the text this token added, so an earlier, ignored match never fires later.
            if stops and state.num_tokens_seen + i + 1 > params.min_tokens:
                stop = _find_stop(state.detok.text, num_chars_before, stops)
                if stop is not None:
                    pos, stop_str = stop
                    end = pos + len(stop_str) if params.include_stop_str_in_output else pos
                    state.stopped_text = state.detok.text[:end]
                    seq.stop_reason = stop_str
                    hit_stop = True
                    if i + 1 < len(new_ids):
                        # Speculative decoding emitted tokens past the stop in one step:
                        # they are dropped, never streamed.
                        seq.truncate_output(state.num_tokens_seen + i + 1)
                        outputs = seq.output_token_ids
                        new_ids = new_ids[: i + 1]
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
        new_top_logprobs = seq.output_top_logprobs[state.num_logprobs_seen :]
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
            new_top_logprobs=list(new_top_logprobs),
            top_logprobs=list(seq.output_top_logprobs),
            # Complete before the first token, never changed after: shared, not copied.
            prompt_logprobs=seq.prompt_logprobs,
            prompt_top_logprobs=seq.prompt_top_logprobs,
            prompt_ranks=seq.prompt_ranks,
            stop_reason=seq.stop_reason,
            queue_seconds=seq.queue_seconds,
        )
        if finished:
            self._states.pop(seq.request_id, None)
        return out, hit_stop

    def _new_state(self, seq: Sequence) -> _RequestState:
        """A request's detokenizer and stop state. A migrated request's continuation starts
        where its first replica was: the output it resumes decoded (never checked for stops:
        none ended it), and only the text the client was not sent still to send, so text held
        back for a stop string or a split character comes out as it would have."""
        state = _RequestState(IncrementalDetokenizer(self.tokenizer))
        continuation = seq.params.continuation
        if continuation is not None:
            state.detok.add_tokens(seq.prompt_token_ids[-continuation.num_output_tokens :])
            state.num_chars_sent = min(continuation.num_text_chars, len(state.detok.text))
        return state

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
