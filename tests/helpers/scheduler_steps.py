"""A Scheduler's steps without a model: each step "samples" one fixed token for every sequence
whose scheduled tokens reach its end, so a test sees budgets, chunking, preemption and stops
and nothing of sampling."""

from __future__ import annotations

from splitserve.engine.core.scheduled_batch import ScheduledBatch
from splitserve.engine.core.scheduler import Scheduler

FAKE_TOKEN = 7


def fake_step(sched: Scheduler) -> ScheduledBatch:
    """Schedule, then 'sample' FAKE_TOKEN for every sequence that reached its end."""
    batch = sched.schedule()
    sampled = {
        s.request_id: (FAKE_TOKEN, None)
        for s, n in zip(batch.seqs, batch.num_new_tokens)
        if s.num_computed_tokens + n == s.num_tokens
    }
    sched.update(batch, sampled)
    return batch
