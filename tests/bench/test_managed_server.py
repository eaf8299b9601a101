"""bench/loadgen/managed_server: stop() reaches the server with SIGINT, and the server shuts
down gracefully, even when the process that started it ignores SIGINT (a bench run as a
background job of a non-interactive shell, `nohup ... &`, inherits SIGINT ignored)."""

from __future__ import annotations

import signal
import sys

from splitserve.bench.loadgen.managed_server import ManagedServer

# Answers /health; on SIGINT (KeyboardInterrupt) writes its marker file and exits 0. With SIGINT
# ignored it would only end at stop()'s SIGTERM, without the marker.
GRACEFUL_SERVER = """
import http.server, pathlib, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health)
try:
    server.serve_forever()
except KeyboardInterrupt:
    pathlib.Path(sys.argv[2]).write_text("stopped by SIGINT")
"""


def test_a_server_started_with_sigint_ignored_still_stops_on_sigint(tmp_path):
    script, marker = tmp_path / "graceful_server.py", tmp_path / "graceful"
    script.write_text(GRACEFUL_SERVER)
    server = ManagedServer(f"{sys.executable} {script} {{port}} {marker}", log_path=tmp_path / "server.log")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a `nohup ... &` job inherits
    try:
        server.start()
    finally:
        signal.signal(signal.SIGINT, previous)
    server.stop()
    assert marker.read_text() == "stopped by SIGINT", server.log_tail()
