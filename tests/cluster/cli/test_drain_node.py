"""`splitserve drain-node` (a worker pod's preStop hook): it finds the replica worker processes
by the title Ray gives them, sends each SIGTERM, and returns once they have exited; one that
does not exit is named and the status is 1 at the timeout. Real processes, titled as Ray titles
an actor's (argv[0]); only this test's own processes are signalled (other tests' Ray replicas
may run on the machine)."""

from __future__ import annotations

import subprocess
import sys
import time

from splitserve.cluster.cli.drain_node import drain, replica_processes

# Exits 0.3 s after SIGTERM (a drain takes a moment), writing what it got; or ignores it.
CHILD = """
import signal, sys, time
def on_term(*_):
    print("sigterm", flush=True)
    time.sleep(0.3)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term if sys.argv[1] == "drains" else signal.SIG_IGN)
print("ready", flush=True)
while True:
    time.sleep(0.1)
"""


def titled(title: str, behaviour: str) -> subprocess.Popen:
    child = subprocess.Popen(
        [title, "-c", CHILD, behaviour], executable=sys.executable, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    return child


def test_the_replica_processes_are_found_by_their_ray_title():
    decode = titled("ray::decode-7:DecodeWorker.poll", "drains")
    prefill = titled("ray::PrefillWorker", "drains")
    other = titled("ray::TensorParallelRankActor", "drains")  # a rank goes with its replica
    try:
        found = replica_processes()
        assert found[decode.pid] == "ray::decode-7:DecodeWorker.poll" and prefill.pid in found
        assert other.pid not in found
    finally:
        for child in (decode, prefill, other):
            child.kill()
            child.wait(10)


def test_it_returns_once_every_replica_process_has_exited():
    children = [titled(f"ray::decode-{i}:DecodeWorker", "drains") for i in range(2)]
    started = {c.pid: c.args[0] for c in children}
    assert drain(started, timeout_s=120, poll_s=0.05) == 0
    for child in children:
        assert child.wait(10) == 0 and child.stdout.read().strip() == "sigterm"


def test_one_that_does_not_exit_is_named_at_the_timeout(capsys):
    stuck = titled("ray::decode-8:DecodeWorker", "ignores")
    try:
        begun = time.monotonic()
        assert drain({stuck.pid: stuck.args[0]}, timeout_s=0.5, poll_s=0.05) == 1
        assert time.monotonic() - begun >= 0.5  # it waited the timeout out (a lower bound only)
        assert "ray::decode-8:DecodeWorker" in capsys.readouterr().err
        assert stuck.poll() is None
    finally:
        stuck.kill()
        stuck.wait(10)
