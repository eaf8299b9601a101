"""Where one LLMEngine step spends its time: a per-phase wall-clock split and torch.profiler ops.

The phases are timed by wrapping the engine's own objects' methods on the instance, so what is
measured is exactly the code LLMEngine.step runs. Used by `splitserve.bench.engine.engine_throughput --profile`.
"""

from __future__ import annotations

import functools
import random
import time
from collections import defaultdict

# (attribute path from the engine, phase name), in step order. The model's forward and
# compute_logits are separate so that the lm_head + sampling cost shows apart from the layers.
PHASES = (
    ("scheduler.schedule", "schedule"),
    ("runner.build_metadata", "build tensors"),
    ("model.forward", "model forward"),
    ("model.compute_logits", "lm_head"),
    ("runner.sampler.sample", "sample"),
    ("scheduler.update", "scheduler update"),
    ("outputs.process", "detokenize/outputs"),
)
NUM_TOP_OPS = 12


class PhaseTimer:
    """Accumulates this process's CPU time per phase while installed on an engine. CPU time,
    not wall time: other jobs on a shared machine then inflate it far less, and with one torch
    thread the engine's CPU time is its whole cost."""

    def __init__(self, engine):
        self.engine = engine
        self.seconds: dict[str, float] = defaultdict(float)
        self._installed: list[tuple[object, str]] = []

    def _wrap(self, owner, name: str, phase: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[phase] += time.process_time() - start

        setattr(owner, name, timed)
        self._installed.append((owner, name))

    def __enter__(self) -> PhaseTimer:
        for path, phase in PHASES:
            *parents, name = path.split(".")
            owner = self.engine
            for parent in parents:
                owner = getattr(owner, parent)
            self._wrap(owner, name, phase)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name in self._installed:
            delattr(owner, name)  # the class attribute shows through again
        self._installed.clear()


def _decode_steps(engine, prompts: list[list[int]], max_tokens: int):
    """Admit prompts and run their prefill; returns a function that runs one decode step."""
    from splitserve.proto.messages.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for ids in prompts:
        engine.add_request(prompt_token_ids=ids, params=params)
    while engine.scheduler.waiting:
        engine.step()
    return engine.step


def profile_engine_steps(engine, sizes: list[int], prompt_len: int, max_tokens: int, vocab_size: int, seed: int) -> str:
    """Markdown: per batch size, the phase split of the decode steps and the top torch ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    lines = [
        "## splitserve decode step profile",
        "",
        f"Decode steps only (after the prefill): the first {(max_tokens - 1) // 2} timed per phase in "
        f"CPU ms per step (process time, {torch.get_num_threads()} torch thread(s)), the rest under "
        "torch.profiler. The phases run one after another; other = the glue of LLMEngine.step "
        "and ModelRunner.execute.",
        "",
    ]
    rng = random.Random(seed + 424242)
    tables = []
    for b in sizes:
        prompts = [[rng.randrange(16, vocab_size) for _ in range(prompt_len)] for _ in range(b)]
        with torch.inference_mode():
            step = _decode_steps(engine, prompts, max_tokens)
            num_steps = 0
            with PhaseTimer(engine) as timer:
                start = time.process_time()
                while engine.has_unfinished() and num_steps < (max_tokens - 1) // 2:
                    step()
                    num_steps += 1
                total = time.process_time() - start
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                while engine.has_unfinished():
                    step()
        parts = ", ".join(f"{phase} {1e3 * s / num_steps:.2f}" for phase, s in timer.seconds.items())
        accounted = sum(timer.seconds.values())
        lines.append(
            f"- batch {b}: {1e3 * total / num_steps:.2f} CPU ms/step = {parts}; "
            f"other {1e3 * (total - accounted) / num_steps:.2f}"
        )
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=NUM_TOP_OPS)
        tables += [
            "",
            f"torch.profiler, batch {b}, top ops by self CPU time "
            f"(remaining decode steps, profiler overhead included):",
            "",
            "```",
            table.strip(),
            "```",
        ]
    return "\n".join(lines + tables)
