"""engine/host_heap.py: after retain_freed_heap a forward's buffers freed and allocated again come
from the heap, their pages already resident (few minor faults), where glibc's own thresholds
often hand them back to the OS and fault them in again (4,096 of 4,096 pages measured here,
512 on a busier run: it depends on glibc's allocation history, so only retain is bounded). Each case
runs in a fresh interpreter: the thresholds are process-wide."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from splitserve.engine.host_heap import HOST_HEAP_ENV, host_heap_mode

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# A forward's pattern: several activations allocated, then all freed together.
PROBE = """
import resource, sys, torch
from splitserve.engine.host_heap import retain_freed_heap
print(retain_freed_heap())
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = [torch.empty(512 << 10, dtype=torch.float32) for _ in range(8)]  # 8 x 2 MiB
    for buffer in buffers:
        buffer.fill_(1.0)  # touches every page
    del buffers, buffer
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(max(faults[2:]))
"""
PAGES = (16 << 20) // 4096


def probe(mode: str | None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != HOST_HEAP_ENV}
    if mode is not None:
        env[HOST_HEAP_ENV] = mode
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    retained, faults = out.stdout.split()
    return retained, int(faults)


def test_a_retained_heap_reuses_freed_pages():
    retained, faults = probe(None)  # the default: retain
    assert retained == "True"
    assert faults <= PAGES // 4  # 1/8 measured: one block of eight faulted in again


def test_the_default_mode_leaves_glibc_alone():
    retained, _ = probe("default")  # how often glibc's own thresholds fault varies with its history
    assert retained == "False"


def test_a_bad_mode_names_the_choices(monkeypatch):
    monkeypatch.setenv(HOST_HEAP_ENV, "tcmalloc")
    with pytest.raises(ValueError, match="retain, default"):
        host_heap_mode()
