"""The tenants reload loop cannot die: a malformed tenants file (one that once raised an
IndexError past the loop's handler), a failing lease sync, a failing usage flush and a failing
tick are each logged and counted, the old tenants stay, and the next valid file applies within
two ticks of the loop (ticks counted, not seconds: the bound holds on a busy machine too). The
reload metrics show the error and the recovery. Real TenantGate on a real SQLite store."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.state.database import open_state_engine
from splitserve.cluster.tenants.tenant_gate import TenantGate
from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal
from splitserve.cluster.tenants.tenants_file import TenantsFileError, parse_tenants_yaml

pytestmark = [pytest.mark.timeout(120)]
VALID = "tenants:\n  - {name: a, api_keys: [sk-old]}\n"
REVOKING = "tenants:\n  - {name: a, api_keys: [sk-new]}\n"


@pytest.fixture
def gate(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(VALID)
    cfg = ServeConfig(tenants_file=str(path), tenants_reload_s=0.02, tenant_sync_s=0.02)
    engine = open_state_engine(f"sqlite:///{tmp_path / 'state.db'}")
    registry = CollectorRegistry()
    made = TenantGate(cfg, engine, "ingress-a", TenantMetrics(registry))
    made.path, made.registry = path, registry
    yield made
    engine.dispose()


def write(path, text: str) -> None:
    """A new content, with a new stamp even on a file system with coarse mtimes."""
    before = os.stat(path).st_mtime_ns
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


def sample(gate, name: str, labels=None) -> float:
    return gate.registry.get_sample_value(name, labels or {}) or 0.0


def refused(gate, key: str) -> bool:
    try:
        gate.authenticate(key)
        return False
    except TenantRefusal:
        return True


def test_a_malformed_file_then_a_revoking_one(gate, caplog):
    started = sample(gate, "splitserve_tenants_last_reload_timestamp_seconds")
    assert started > 0
    write(gate.path, "tenants: 5\n")
    with caplog.at_level(logging.ERROR):
        asyncio.run(gate.tick())
        asyncio.run(gate.tick())  # the same file again: logged and counted once per change
    assert caplog.text.count("tenants file not reloaded") == 1 and "line 1" in caplog.text
    assert sample(gate, "splitserve_tenants_reload_errors_total") == 1
    assert not refused(gate, "sk-old")  # the old tenants stay
    write(gate.path, REVOKING)
    asyncio.run(gate.tick())
    assert refused(gate, "sk-old") and not refused(gate, "sk-new")
    assert sample(gate, "splitserve_tenants_last_reload_timestamp_seconds") >= started
    assert sample(gate, "splitserve_tenants_reload_errors_total") == 1


def test_failing_lease_sync_and_usage_flush_never_stop_a_reload(gate, monkeypatch):
    async def broken_sync():
        raise ConnectionError("state store unreachable")

    def broken_flush():
        raise RuntimeError("usage not written")

    monkeypatch.setattr(gate.limiter, "sync", broken_sync)
    monkeypatch.setattr(gate.meter, "flush", broken_flush)
    write(gate.path, REVOKING)
    asyncio.run(gate.tick())
    assert refused(gate, "sk-old")
    for stage in ("leases", "usage"):
        assert sample(gate, "splitserve_tenant_sync_errors_total", {"stage": stage}) == 1


def test_the_background_loop_survives_and_revokes_within_two_ticks(gate, monkeypatch):
    ticks = 0
    real_tick = gate.tick
    faults = iter([RuntimeError("a bug in a tick"), None])

    async def counted_tick():
        nonlocal ticks
        try:
            fault = next(faults, None)
            if fault is not None:
                raise fault
            await real_tick()
        finally:
            ticks += 1

    async def sync_fails():
        raise ConnectionError("state store unreachable")

    monkeypatch.setattr(gate, "tick", counted_tick)
    monkeypatch.setattr(gate.limiter, "sync", sync_fails)

    async def scenario():
        gate.start()
        try:

            async def ticks_pass(n: int) -> None:
                target = ticks + n
                while ticks < target:  # a tick's length is the machine's; the count is not
                    await asyncio.sleep(0.005)

            await ticks_pass(2)  # the failing tick is behind us, and the loop still ticks
            write(gate.path, "tenants: 5\n")
            await ticks_pass(2)
            assert not refused(gate, "sk-old")
            write(gate.path, REVOKING)
            await ticks_pass(2)  # within 2 x tenants_reload_s, as ticks
            assert refused(gate, "sk-old")
        finally:
            await gate.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
    assert sample(gate, "splitserve_tenants_reload_errors_total") == 1


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200) | st.sampled_from(["tenants: 5", "tenants: [5]", "- 5", "tenants: {a: 1}", "[[]]"]))
def test_any_text_is_tenants_or_a_tenants_file_error(text):
    try:
        assert isinstance(parse_tenants_yaml(text), list)
    except TenantsFileError:
        pass
