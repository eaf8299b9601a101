"""CompletionRenderer: /v1/completions choices (text, logprobs with text_offset, echo, the
prompt's log-probabilities ahead of the completion's with echo + logprobs, vLLM's
prompt_logprobs field); the streaming and accumulation are ResponseRenderer's (render.py)."""

from __future__ import annotations

from splitserve.cluster.frontend.openai.choice import ChoiceState
from splitserve.cluster.frontend.openai.render import ResponseRenderer
from splitserve.cluster.frontend.openai.responses import CompletionChoice, CompletionLogprobs, CompletionResponse


class CompletionRenderer(ResponseRenderer):
    chunk_object = "text_completion"

    def __init__(
        self,
        *args,
        num_top_logprobs: int = 0,
        echo_token_ids: list[list[int]] | None = None,
        echo_only: bool = False,
        **kwargs,
    ):
        """echo_token_ids: per prompt, its token ids, when the prompt is echoed with its
        log-probabilities (echo with logprobs): its entries go ahead of the completion's (in
        the first chunk when streamed), as vLLM's and OpenAI's. echo_only: echo with
        max_tokens 0, the prompt alone (CompletionRequest.echo_only)."""
        super().__init__(*args, **kwargs)
        for choice in self.choices:
            choice.echo_only = echo_only
        self.num_top_logprobs = num_top_logprobs
        self.echo_token_ids = echo_token_ids
        self._text_offsets = self._initial_offsets()

    def _initial_offsets(self) -> dict[int, int]:
        # With the prompt's entries, offsets count from the prompt's first token.
        return {c.index: 0 if self.echo_token_ids is not None else len(c.echo) for c in self.choices}

    def _entries(self, choice: ChoiceState, start: int) -> tuple[list[int], list, list]:
        """(token ids, log-probabilities, top alternatives) from output token `start` on, with
        the prompt's ahead of them from the start when echoed (its first token has none)."""
        token_ids = choice.token_ids[start:]
        logprobs: list[float | None] = list(choice.logprobs[start:])
        tops: list = list(choice.top_logprobs[start:])
        if start == 0 and self.echo_token_ids is not None:
            prompt = self.echo_token_ids[choice.prompt_index]
            if len(choice.prompt_logprobs) == len(prompt) - 1:  # none: no chunk came
                token_ids = prompt + token_ids
                logprobs = [None, *choice.prompt_logprobs, *logprobs]
                tops = [None, *choice.prompt_top_logprobs, *tops]
        return token_ids, logprobs, tops

    def _logprobs(self, choice: ChoiceState, start: int) -> CompletionLogprobs | None:
        if not self.include_logprobs:
            return None
        token_ids, logprobs, tops = self._entries(choice, start)
        tokens = [self.token_string(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offsets[choice.index])
            self._text_offsets[choice.index] += len(token)
        top = None
        if self.num_top_logprobs:
            top = []
            for token_id, logprob, alternatives in zip(token_ids, logprobs, tops):
                if logprob is None:  # the first prompt token: nothing before it
                    top.append(None)
                    continue
                entry: dict[str, float] = {}
                # Most likely first; tokens decoding alike keep the first. (A prompt position may
                # have more: vLLM's prompt_logprobs field asked for more than logprobs.)
                for t, lp in alternatives[: self.num_top_logprobs]:
                    entry.setdefault(self.token_string(t), lp)
                # As OpenAI and vLLM: the chosen token is always listed (up to logprobs + 1).
                entry.setdefault(self.token_string(token_id), logprob)
                top.append(entry)
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs, top_logprobs=top, text_offset=offsets)

    def render_choice(self, choice, text, first_token, finish_reason) -> dict:
        logprobs = self._logprobs(choice, first_token)
        return {
            "index": choice.index,
            "text": text,
            "logprobs": None if logprobs is None else logprobs.model_dump(mode="json"),
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason if finish_reason else None,
        }

    def render_usage_chunk(self) -> dict:
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[], usage=self.usage()
        ).model_dump(mode="json")

    def render_response(self) -> dict:
        self._text_offsets = self._initial_offsets()
        choices = [
            CompletionChoice(
                index=c.index,
                text=c.text,
                logprobs=self._logprobs(c, 0),
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=self.prompt_logprobs(c),
            )
            for c in self.choices
        ]
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        ).model_dump(mode="json")
