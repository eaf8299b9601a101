"""Fixtures shared by the bench tests."""

from __future__ import annotations

import pytest

from tests.helpers.bench_fake_server import FakeServerState, FakeServerThread


@pytest.fixture(scope="module")
def fake_server():
    """A fake streaming server in a thread, one per test module: its emulated prefix cache fills
    up as a module's tests send prompts, so modules do not see each other's prompts."""
    server = FakeServerThread(FakeServerState(ttft_s=0.02, itl_s=0.003)).start()
    yield server
    server.stop()
