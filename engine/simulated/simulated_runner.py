"""SimulatedRunner: the simulated engine's forward -- a wait as long as the step-time profile
says the step takes (slowed speed_factor times), and deterministic tokens.

The wait is split evenly over the model's layers, each followed by the step's layer callback,
as a real forward calls it: the prefill worker's layer-wise KV sends and the fault injector's
mid-forward faults run in the same places as with the real engine.

Tokens: each request's output is a fixed function of (engine seed, its prompt tokens, the
position), drawn from the vocabulary without the EOS tokens -- the same on every replica, so
a prefill replica's first token and a decode replica's next ones belong to one "model". A
request ends at max_tokens, at a stop token it drew, or at the context limit (the scheduler
checks these, as for the real engine); never by EOS, as if every request set ignore_eos.
Log-probabilities are those of a uniform model, -log(vocab size).
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from collections import deque
from collections.abc import Callable

from splitserve.engine.core.scheduler import ScheduledBatch
from splitserve.engine.core.sequence import Sequence
from splitserve.engine.simulated.step_time_profile import StepTimeProfile

# What prepare() reads for run(): the profile's seconds, and (sequence, position) per token sampled.
SimulatedStep = tuple[float, list[tuple[Sequence, int]]]


class SimulatedRunner:
    def __init__(
        self,
        profile: StepTimeProfile,
        num_layers: int,
        vocab_size: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        seed: int = 0,
        speed_factor: float = 1.0,
        history: int = 1024,
    ):
        self.profile = profile
        self.num_layers = num_layers
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.seed = seed
        self.speed_factor = speed_factor
        self.logprob = -math.log(vocab_size)
        self._keys: dict[str, bytes] = {}
        self.num_steps = 0
        self.simulated_seconds = 0.0  # the profile's time of every step so far
        # (predicted wall seconds, measured wall seconds) of recent steps: the timing tests'.
        self.step_times: deque[tuple[float, float]] = deque(maxlen=history)

    def predict_s(self, batch: ScheduledBatch) -> float:
        """The profile's (simulated) seconds for this batch."""
        new_tokens = sum(batch.num_new_tokens)
        context = sum(seq.num_computed_tokens + n for seq, n in zip(batch.seqs, batch.num_new_tokens))
        return self.profile.step_s(new_tokens, context)

    def prepare(self, batch: ScheduledBatch) -> SimulatedStep | None:
        """The step's profile seconds and which sequences sample the token at which position,
        read on the loop thread (with async scheduling the sequences move on while it runs)."""
        if batch.is_empty:
            return None
        samples = [
            (seq, seq.num_computed_tokens + n)
            for seq, n in zip(batch.seqs, batch.num_new_tokens)
            if seq.num_computed_tokens + n == seq.num_tokens_with_placeholders  # reached its end: it samples
        ]
        return self.predict_s(batch), samples

    def run(
        self,
        step: SimulatedStep | None,
        on_layer_done: Callable[[int], None] | None = None,
        previous: dict | None = None,
        before_sampling: Callable[[], None] | None = None,
    ) -> dict:
        """The profile's wait, then the tokens. previous and before_sampling (async scheduling)
        are not needed: a token depends on its request's prompt and position only."""
        if step is None:
            return {}
        simulated_s, samples = step
        wall_s = simulated_s * self.speed_factor
        start = time.perf_counter()
        if on_layer_done is None:
            _sleep_until(start + wall_s)
        else:
            for layer in range(self.num_layers):
                _sleep_until(start + wall_s * (layer + 1) / self.num_layers)
                on_layer_done(layer)
        self.step_times.append((wall_s, time.perf_counter() - start))
        self.num_steps += 1
        self.simulated_seconds += simulated_s
        return {seq.request_id: self._sample(seq, position) for seq, position in samples}

    def execute(self, batch: ScheduledBatch, on_layer_done: Callable[[int], None] | None = None) -> dict:
        return self.run(self.prepare(batch), on_layer_done)

    def _sample(self, seq: Sequence, position: int) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        token = self.token_at(seq, position)
        params = seq.params
        logprob = self.logprob if params.logprobs else None
        top = None
        if params.top_logprobs:
            k = params.top_logprobs
            alternatives = [token] + [t for t in range(k) if t != token][: k - 1]
            top = [(t, self.logprob) for t in alternatives]
        return token, logprob, top

    def token_at(self, seq: Sequence, position: int) -> int:
        """The request's token at this position: a hash of (seed, prompt, position), never EOS."""
        key = self._keys.get(seq.request_id)
        if key is None:
            ids = seq.prompt_token_ids
            prompt = struct.pack(f"<{len(ids)}I", *ids)  # each id as 4 little-endian bytes
            key = hashlib.blake2b(prompt, digest_size=16, key=self.seed.to_bytes(8, "little")).digest()
            self._keys[seq.request_id] = key
        digest = hashlib.blake2b(position.to_bytes(8, "little"), digest_size=8, key=key).digest()
        token = int.from_bytes(digest, "little") % self.vocab_size
        while token in self.eos_token_ids:
            token = (token + 1) % self.vocab_size
        return token

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)

    def stats(self) -> dict:
        return {}


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)
