"""Engine tests over both step modes: a test module that sets `BOTH_SCHEDULINGS = True` runs
every test that builds an engine from `tiny_model` twice, once with async scheduling (forced
on, as a GPU engine runs by default; every step scheduled ahead however small) and once with
the synchronous step (`--no-async-scheduling`, a CPU engine's default). Its module-scoped engines are built once per mode: `tiny_model`
depends on the mode."""

from __future__ import annotations

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.step_pipeline import StepPipeline

MODES = {"async": True, "sync": False}


def pytest_generate_tests(metafunc):
    if "scheduling" in metafunc.fixturenames and getattr(metafunc.module, "BOTH_SCHEDULINGS", False):
        metafunc.parametrize("scheduling", list(MODES), indirect=True, scope="module")


@pytest.fixture(scope="module")
def scheduling(request):
    """The step mode every EngineConfig of the module gets ("async" / "sync"), or None where
    the module runs one mode (the default, or what each test sets)."""
    mode = getattr(request, "param", None)
    if mode is None:
        yield None
        return
    original = EngineConfig.__post_init__

    def forced(self: EngineConfig) -> None:
        original(self)
        self.async_scheduling = MODES[mode]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineConfig, "__post_init__", forced)
        # Every step goes ahead, however few requests it has (CPU defaults to >= 4).
        patch.setattr(StepPipeline, "CPU_MIN_REQUESTS", 1)
        yield mode


@pytest.fixture(scope="module")
def tiny_model(tiny_model, scheduling) -> str:
    return tiny_model
