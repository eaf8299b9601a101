"""The preflight names the process holding a taken port, with its PID: a child process holds the
port (as a stale HAProxy would after `ray stop`) and the one-line error names it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitserve.cluster.cli.preflight import PreflightError, check_ports, port_holder
from splitserve.cluster.config import ServeConfig

HOLDER = """
import socket, sys, time
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
print(sock.getsockname()[1], flush=True)
sys.stdin.read()  # hold the port until the test closes our stdin
"""


def _hold_port(executable: str):
    child = subprocess.Popen([executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        yield child, port
    finally:
        child.stdin.close()
        child.wait(timeout=30)


@pytest.fixture
def held_port():
    yield from _hold_port(sys.executable)


def test_a_taken_port_names_its_holder_and_pid(held_port):
    child, port = held_port
    cfg = ServeConfig(http_host="127.0.0.1", http_port=port, grpc_port=0)
    with pytest.raises(PreflightError) as err:
        check_ports(cfg)
    message = str(err.value)
    assert f"127.0.0.1:{port}" in message and "--port" in message
    assert f"pid {child.pid}" in message, message
    assert "haproxy" not in message.lower()  # the hint is for HAProxy only


def test_a_free_port_passes_and_has_no_holder(held_port):
    child, port = held_port
    child.stdin.close()
    child.wait(timeout=30)  # the port is free again
    assert port_holder(port) == ""
    check_ports(ServeConfig(http_host="127.0.0.1", http_port=port, grpc_port=0))


def test_a_stale_haproxy_is_named_with_how_to_stop_it(tmp_path):
    """A process named haproxy (this Python, run through a link of that name) holding the port."""
    haproxy = tmp_path / "haproxy"
    haproxy.symlink_to(sys.executable)
    for child, port in _hold_port(str(haproxy)):
        with pytest.raises(PreflightError) as err:
            check_ports(ServeConfig(http_host="127.0.0.1", http_port=port, grpc_port=0))
        assert f"(held by haproxy, pid {child.pid}: a stale Ray HAProxy? stop it with `kill {child.pid}`)" in str(
            err.value
        )
