"""One request's token state as the scheduler sees it. No tensors live here."""

from __future__ import annotations

import enum
import time

from splitserve.engine.core.block_hash import ROOT_HASH, extend_hashes
from splitserve.proto.messages.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill-only request done; blocks held for the KV handoff
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        block_size: int,
        arrival_time: float | None = None,
        prefill_only: bool = False,
        root_hash: int = ROOT_HASH,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)  # prompt + output
        self.params = params
        self.block_size = block_size
        self.prefill_only = prefill_only
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Async scheduling (engine/step_pipeline.py): tokens a submitted step will sample for
        # this request, not appended yet. num_computed_tokens already counts the positions
        # such a step computes; the next step's decode row reads its placeholder's token on
        # the forward thread. Always 0 with the synchronous step.
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache (first admission)
        self.num_registered_blocks = 0  # leading full blocks already entered into the prefix cache
        self.block_table: list[int] = []
        # Leading table entries whose blocks are freed: no query of a sliding-window model sees
        # them any more (engine/core/kv_cache_manager.py); they hold SKIPPED_BLOCK.
        self.num_skipped_blocks = 0
        self.block_hashes: list[int] = []  # chained hashes of every full block of token_ids
        self.root_hash = root_hash  # the chain's root: the engine's model seed (block_hash.root_hash)
        self.output_logprobs: list[float] = []
        # Per output token, when params.top_logprobs: the most likely (token id, logprob) pairs.
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # With params.prompt_logprobs: entry i is prompt token i + 1's log-probability given the
        # tokens before it (the first prompt token has none), and its top alternatives (when
        # prompt_logprobs > 0). Filled as the prompt's chunks compute; complete before the first token.
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        self.prompt_ranks: list[int] = []  # each prompt token's rank in its distribution (1: most likely)
        self.finish_reason: str | None = None
        # What stopped it (vLLM's stop_reason): the stop token id, the stop string, or None
        # (EOS, length, abort). A stop token's text is left out unless include_stop_str_in_output.
        self.stop_reason: int | str | None = None
        self.stopped_by_token = False  # it sampled EOS or one of its stop_token_ids (not a grammar's end)
        self.queue_seconds: float | None = None  # arrival -> first scheduled (vLLM's queue time)
        self.num_preemptions = 0
        self.first_admitted = False
        # A GrammarMatcher (engine/structured_output) when the output is constrained; opaque here.
        self.grammar = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt log-probabilities and some are still to compute."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def add_prompt_logprobs(
        self, logprobs: list[float], top_logprobs: list[list[tuple[int, float]]], ranks: list[int]
    ) -> None:
        """The next prompt positions' log-probabilities and ranks (top_logprobs: empty, or one list each)."""
        self.prompt_logprobs.extend(logprobs)
        self.prompt_top_logprobs.extend(top_logprobs)
        self.prompt_ranks.extend(ranks)

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.PREFILLED)

    def update_block_hashes(self) -> list[int]:
        """Hash any blocks that became full; returns the new hashes."""
        return extend_hashes(self.block_hashes, self.token_ids, self.block_size, self.root_hash)

    def append_token(
        self, token_id: int, logprob: float | None = None, top_logprobs: list[tuple[int, float]] | None = None
    ) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens past the first num_output_tokens (a stop string ended the
        request inside a step's run of accepted speculative tokens: nothing past it is kept)."""
        keep = self.num_prompt_tokens + num_output_tokens
        del self.token_ids[keep:]
        del self.output_logprobs[num_output_tokens:]
        del self.output_top_logprobs[num_output_tokens:]
        del self.block_hashes[keep // self.block_size :]

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table) - self.num_skipped_blocks})"
        )
