"""Run the `splitserve` CLI in the test's own process: main() is the console script's entry
point, and a subprocess per call would only add an interpreter start and a torch import
(tests/cluster/test_serve_cli.py keeps the subprocess checks of the entry point itself)."""

from __future__ import annotations

import subprocess


def run_cli(capsys, *argv: str) -> subprocess.CompletedProcess:
    """`splitserve *argv`: its exit code, stdout and stderr (capsys captures them)."""
    from splitserve.cluster.cli.main import main

    capsys.readouterr()  # drop what the test printed before
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: --help, usage errors
        code = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), code, out.out, out.err)
