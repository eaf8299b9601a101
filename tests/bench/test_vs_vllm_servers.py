"""bench/serving/vs_vllm_servers: a variant started for real (a small HTTP server under
/bin/sh, as vs_vllm_bench starts every server) runs its base's command with the extra arguments
and environment, and the base stays as it was."""

from __future__ import annotations

import sys

import httpx
import pytest

from splitserve.bench.loadgen.managed_server import ManagedServer
from splitserve.bench.serving.vs_vllm_servers import ServerUnderTest, shell_command, with_overrides

# Answers /health, and /echo with its argv and the variable SETTING (JSON).
ECHO_SERVER = """
import http.server, json, os, sys
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"argv": sys.argv[2:], "setting": os.environ.get("SETTING")}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
"""


def _echo(server: ServerUnderTest, tmp_path) -> dict:
    with ManagedServer(shell_command(server), log_path=tmp_path / f"{server.name}.log") as managed:
        return httpx.get(f"{managed.base_url}/echo", timeout=30).json()


def test_a_variant_runs_its_bases_command_with_its_own_arguments_and_environment(tmp_path):
    script = tmp_path / "echo_server.py"
    script.write_text(ECHO_SERVER)
    base = ServerUnderTest("echo", f"{sys.executable} {script} {{port}} --base-flag", {"SETTING": "base"})
    servers = with_overrides(
        {"echo": base},
        variants=["echo-1t=echo"],
        server_args=["echo-1t=--decode.torch-threads 1", "echo-1t=--more"],
        server_envs=["echo-1t=SETTING=two words; $HOME"],
    )
    assert servers["echo"] == base
    assert _echo(servers["echo-1t"], tmp_path) == {
        "argv": ["--base-flag", "--decode.torch-threads", "1", "--more"],
        "setting": "two words; $HOME",  # quoted for the shell: passed as written
    }
    assert _echo(servers["echo"], tmp_path) == {"argv": ["--base-flag"], "setting": "base"}


@pytest.mark.parametrize(
    ("variants", "args", "envs", "message"),
    [
        (["copy=nope"], [], [], "no server 'nope'"),
        (["echo=echo"], [], [], "already a server"),
        ([], ["missing=--x"], [], "no server 'missing'"),
        ([], ["--x"], [], "takes NAME="),
        ([], [], ["echo=NOVALUE"], "NAME=KEY=VALUE"),
    ],
)
def test_unknown_names_and_malformed_values_are_refused(variants, args, envs, message):
    base = ServerUnderTest("echo", "true {port}", {})
    with pytest.raises(ValueError, match=message):
        with_overrides({"echo": base}, variants, args, envs)
