"""More LoRA adapters than device slots (engine/lora/lora_slots.py, lora_host_cache.py,
engine/core/lora_admission.py): adapters wait in an LRU host cache of max_cpu_loras (re-read
from their directory on a miss) and are copied into a slot when a step needs them. No step
uses more than max_loras adapters, nothing deadlocks or starves, an adapter evicted to the host
(or out of it) and loaded back gives the same greedy tokens, and loads and evictions are
counted by tier. Adapters load and unload at runtime (unload refused while requests use one)."""

from __future__ import annotations

import pytest

from splitserve.engine.core.scheduler import Scheduler
from splitserve.engine.engine_errors import LoraAdapterBusyError
from splitserve.engine.lora.peft_checkpoint import LoraAdapterError
from splitserve.proto.messages.engine_stats import EngineStats
from splitserve.proto.messages.invalid_request import InvalidRequestError
from tests.engine import test_lora
from tests.engine.test_lora import ADAPTERS, PROMPTS, assert_baseline, greedy
from tests.helpers.handoff import finish_all, hand_off
from tests.helpers.peft_adapters import lora_engine

# test_lora's checkpoint, adapters and transformers + peft's tokens, and its one torch thread.
checkpoint = test_lora.checkpoint
expected = test_lora.expected
pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES: list[str | None] = [None, *ADAPTERS]


@pytest.fixture
def step_adapters(monkeypatch) -> list[set[str]]:
    """Every scheduled step's distinct adapters, recorded from the scheduler's batches."""
    recorded: list[set[str]] = []
    schedule = Scheduler.schedule

    def recording(self, *args, **kwargs):
        batch = schedule(self, *args, **kwargs)
        recorded.append({seq.params.lora_adapter for seq in batch.seqs} - {None})
        return batch

    monkeypatch.setattr(Scheduler, "schedule", recording)
    return recorded


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_four_adapters_on_two_slots_each_give_their_solo_tokens(checkpoint, expected, step_adapters, async_scheduling):
    """Four adapters and the base at once on 2 slots and a host cache of 3: each request gets
    transformers + peft's tokens, no step uses more than 2 adapters, and the slots and the host
    cache both evicted (a host miss read an adapter from its directory again)."""
    engine = lora_engine(checkpoint, max_loras=2, max_cpu_loras=3, async_scheduling=async_scheduling)
    outputs = engine.generate(PROMPTS, [greedy(name) for name in NAMES])
    for index, (name, out) in enumerate(zip(NAMES, outputs)):
        assert out.token_ids == expected[name][index], name
    assert max(len(adapters) for adapters in step_adapters) == 2
    stats = engine.stats()
    assert isinstance(stats, EngineStats)
    # 4 read at start (the first 3 kept), 2 copied into the slots at start; then the other
    # two adapters each took a slot (evicting one), and the one not cached was read again.
    assert stats.lora_loads["device"] >= 4 and stats.lora_evictions["device"] >= 2
    assert stats.lora_loads["host"] >= 5 and stats.lora_evictions["host"] >= 1
    assert len(stats.lora_recent_load_seconds["device"]) == stats.lora_loads["device"]
    assert all(seconds > 0 for seconds in stats.lora_recent_load_seconds["host"])
    assert stats.lora_slots_used == 2 and len(stats.lora_device_adapters) == 2
    assert set(stats.lora_device_adapters) <= set(stats.lora_host_adapters) | set(ADAPTERS)
    assert len(stats.lora_host_adapters) == 3
    assert_baseline(engine)


def test_an_adapter_evicted_to_the_host_and_out_of_it_gives_the_same_tokens(checkpoint, expected):
    """One slot and a host cache of 1: every other adapter evicts "attn" from the slot and
    from the host; loaded back (read again from its directory) it gives the same tokens."""
    engine = lora_engine(checkpoint, max_loras=1, max_cpu_loras=1)
    prompt, want = PROMPTS[1], expected["attn"][1]
    first = engine.generate([prompt], greedy("attn"))[0].token_ids
    assert first == want
    device_loads = engine.stats().lora_loads["device"]
    for other in ("mlp", "all-rs", "qv"):
        engine.generate([PROMPTS[2]], greedy(other))
    stats = engine.stats()
    assert "attn" not in stats.lora_device_adapters and "attn" not in stats.lora_host_adapters
    assert stats.lora_device_adapters == stats.lora_host_adapters == ["qv"]
    again = engine.generate([prompt], greedy("attn"))[0]
    assert again.token_ids == first
    assert engine.stats().lora_loads["device"] == device_loads + 4
    assert_baseline(engine)


def test_a_cold_adapter_is_not_starved_by_a_stream_of_hot_ones(checkpoint, step_adapters):
    """One slot: "hot" requests keep arriving every step while a "qv" request waits behind
    the first. It is admitted once the hot ones ahead of it finish (those behind it wait),
    and every request finishes: no deadlock, no starvation."""
    engine = lora_engine(checkpoint, max_loras=1, max_num_batched_tokens=64)
    params = greedy("attn", max_tokens=4)
    engine.add_request(prompt_token_ids=PROMPTS[0], params=params, request_id="hot-0")
    engine.add_request(prompt_token_ids=PROMPTS[1], params=greedy("qv", max_tokens=4), request_id="cold")
    finished: dict[str, int] = {}
    for step in range(60):
        if step < 40:
            engine.add_request(prompt_token_ids=PROMPTS[2], params=params, request_id=f"hot-{step + 1}")
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = step
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    assert len(finished) == 42
    # The cold request finished long before the stream of hot requests ended.
    assert finished["cold"] < 15 < finished["hot-40"]
    assert max(len(adapters) for adapters in step_adapters) == 1
    assert_baseline(engine)


def test_handed_off_requests_of_more_adapters_than_slots_take_turns(checkpoint, expected, step_adapters):
    """Disaggregated decode admits whatever prefill hands it: four adapters' requests on a
    decode engine of 2 slots run at most 2 adapters a step, and each gets its own tokens."""
    prefill, decode = lora_engine(checkpoint), lora_engine(checkpoint, max_loras=2)
    outputs = {}
    for index, (name, prompt) in enumerate(zip(NAMES, PROMPTS)):
        first, _ = hand_off(prefill, decode, prompt, greedy(name), f"r{index}")
        outputs[f"r{index}"] = [first]
    step_adapters.clear()  # the prefill engine's steps (4 slots) are not the decode's
    finish_all(decode, outputs)
    for index, name in enumerate(NAMES):
        assert outputs[f"r{index}"][-1].token_ids == expected[name][index], name
    assert max(len(adapters) for adapters in step_adapters) == 2
    assert_baseline(prefill)
    assert_baseline(decode)


def test_an_adapter_loaded_at_runtime_serves_the_next_request_and_a_bad_one_changes_nothing(checkpoint, expected):
    base, adapters = checkpoint
    served = {name: str(adapters[name]) for name in ("attn", "mlp")}
    engine = lora_engine(checkpoint, lora_modules=served, max_loras=1)
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'qv'"):
        engine.add_request(prompt_token_ids=PROMPTS[4], params=greedy("qv"))
    engine.load_lora_adapter("qv", str(adapters["qv"]))
    assert engine.generate([PROMPTS[4]], greedy("qv"))[0].token_ids == expected["qv"][4]
    refusals = {
        "qv": (str(adapters["qv"]), "LoRA adapter 'qv' is already served"),
        "big": (str(adapters["all-rs"]), "LoRA adapter 'big': rank 16 is above max_lora_rank=8"),
        "gone": (str(base / "missing"), "LoRA adapter 'gone': .*missing is not a directory"),
    }
    small = lora_engine(checkpoint, lora_modules=served, max_lora_rank=8)
    for name, (path, message) in refusals.items():
        target = small if name == "big" else engine
        with pytest.raises(LoraAdapterError, match=message) as refused:
            target.load_lora_adapter(name, path)
        assert "\n" not in str(refused.value)
    assert sorted(engine.config.lora_modules or {}) == ["attn", "mlp", "qv"]
    assert "big" not in (small.config.lora_modules or {})
    assert_baseline(engine)


def test_unloading_an_adapter_requests_use_is_refused_until_they_finish(checkpoint, expected):
    """The policy: refuse (LoraAdapterBusyError, the HTTP 409) while any request waits for or
    runs with the adapter; it stays served and they finish with its tokens."""
    engine = lora_engine(checkpoint)
    engine.add_request(prompt_token_ids=PROMPTS[1], params=greedy("attn"), request_id="user")
    with pytest.raises(LoraAdapterBusyError, match="LoRA adapter 'attn' is in use by 1 request"):
        engine.unload_lora_adapter("attn")  # waiting
    outputs = {"user": [engine.step()[0]]}
    with pytest.raises(LoraAdapterBusyError):
        engine.unload_lora_adapter("attn")  # running
    finish_all(engine, outputs)
    assert outputs["user"][-1].token_ids == expected["attn"][1]
    engine.unload_lora_adapter("attn")
    assert "attn" not in engine.stats().lora_device_adapters + engine.stats().lora_host_adapters
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'attn'"):
        engine.add_request(prompt_token_ids=PROMPTS[1], params=greedy("attn"))
    with pytest.raises(LoraAdapterError, match="LoRA adapter 'attn' is not served"):
        engine.unload_lora_adapter("attn")
    # The others serve on, and the adapter can be loaded again.
    assert engine.generate([PROMPTS[2]], greedy("mlp"))[0].token_ids == expected["mlp"][2]
    engine.load_lora_adapter("attn", str(checkpoint[1]["attn"]))
    assert engine.generate([PROMPTS[1]], greedy("attn"))[0].token_ids == expected["attn"][1]
    assert_baseline(engine)
