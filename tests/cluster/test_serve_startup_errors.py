"""`splitserve serve`'s start-up errors: model, draft-model, max_model_len and port problems found
before Ray starts, each one line; and a failure inside the workers (the one test here that
starts Ray) printed once, its root cause last."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from splitserve.cluster.cli import serve as serve_command
from splitserve.cluster.cli.main import main


@pytest.fixture
def scratch_env(monkeypatch):
    """run_serve sets Ray's env vars before it checks the model; keep them out of this process."""
    monkeypatch.setattr(os, "environ", dict(os.environ))


def _broken_copy(tiny_model: str, tmp_path, breakage: str):
    model = tmp_path / breakage
    shutil.copytree(tiny_model, model)
    if breakage == "no-config":
        (model / "config.json").unlink()
    elif breakage == "bad-tokenizer":
        (model / "tokenizer.json").write_text("{not json")
    elif breakage == "truncated-weights":
        with open(model / "model.safetensors", "r+b") as f:
            f.truncate(100)
    elif breakage == "no-weights":
        (model / "model.safetensors").unlink()
    return str(model)


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("missing", "does not exist"),
        ("no-config", "no config.json"),
        ("bad-tokenizer", "tokenizer.json"),
        ("truncated-weights", "cannot read"),
        ("no-weights", "model.safetensors"),
    ],
)
def test_model_problems_are_found_before_ray_starts(
    tiny_model, tmp_path, breakage, message, capsys, scratch_env, monkeypatch
):
    model = str(tmp_path / "nowhere") if breakage == "missing" else _broken_copy(tiny_model, tmp_path, breakage)

    def start_ray(*args, **kwargs):
        raise AssertionError("serve went on to start Ray")

    monkeypatch.setattr(serve_command, "_serve", start_ray)  # what starts Ray, Serve and the app
    assert main(["serve", model]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitserve serve: error: model {model}") and message in err and err.count("\n") == 1


def test_draft_model_problems_are_found_before_ray_starts(tiny_model, models_root, tmp_path, capsys, scratch_env):
    from tests.helpers.model import make_checkpoint

    missing = str(tmp_path / "no-draft")
    assert main(["serve", tiny_model, "--speculative.method", "draft", "--speculative.draft-model", missing]) == 2
    err = capsys.readouterr().err
    assert f"draft model {missing}" in err and "does not exist" in err and err.count("\n") == 1
    other_vocab = str(make_checkpoint(models_root, "draft", "llama"))
    assert main(["serve", tiny_model, "--speculative.method", "draft", "--speculative.draft-model", other_vocab]) == 2
    assert "the draft must use the same tokenizer" in capsys.readouterr().err


def test_max_model_len_and_taken_port_are_found_before_ray_starts(tiny_model, capsys, scratch_env):
    assert main(["serve", tiny_model, "--max-model-len", "99999"]) == 2
    assert "max_model_len 99999 exceeds the model's context of 1024 tokens" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", tiny_model, "--grpc-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen for gRPC on 127.0.0.1:{port}" in err and "--grpc-port" in err


@pytest.mark.e2e  # `splitserve serve` runs until Ray Serve starts its replicas
def test_failed_start_prints_the_root_cause_once(tiny_model, tmp_path):
    """Weights that do not fit config.json pass every check before Ray and fail in the workers:
    the command exits 1 after one attempt and names the cause once, as its last line."""
    model = tmp_path / "mismatch"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["intermediate_size"] *= 2
    (model / "config.json").write_text(json.dumps(config))
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(str(s.getsockname()[1]))
    res = subprocess.run(
        [sys.executable, "-m", "splitserve.cluster.cli", "serve", str(model), "--port", ports[0]]
        + ["--grpc-port", ports[1], "--num-cpus", "4"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    ours = [line for line in res.stderr.splitlines() if line.startswith("splitserve serve: error:")]
    assert res.returncode == 1, res.stdout + res.stderr
    assert ours == [res.stderr.strip().splitlines()[-1]]
    assert "the server failed to start: CheckpointError: weight" in ours[0] and "implies" in ours[0], ours
    # Ray Serve's own tracebacks stay in its log files; one attempt, not Serve's three.
    assert "ServeController" not in res.stderr and "Deploying application" not in res.stderr


def test_root_cause_is_the_innermost_exception_line():
    from splitserve.cluster.startup_error import StartupError, root_cause, startup_error_in

    # What Ray makes of an actor whose constructor raised: the original is the last line.
    ray_text = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::PrefillWorker.__init__()\x1b[39m\n"
        '  File "llama.py", line 101, in load_weights\n'
        "splitserve.engine.model.checkpoint.CheckpointError: weight w has shape (64, 128), config.json implies (64, 192)"
    )
    assert (
        root_cause(RuntimeError(ray_text))
        == "CheckpointError: weight w has shape (64, 128), config.json implies (64, 192)"
    )
    try:
        try:
            raise OSError("port taken")
        except OSError as inner:
            raise RuntimeError("wrapper") from inner
    except RuntimeError as outer:
        assert root_cause(outer) == "OSError: port taken"
    assert root_cause(ValueError("")) == "ValueError"
    status_message = f"Traceback ...\n  raise StartupError(x)\nsplitserve.cluster.startup_error.{StartupError.__name__}: CheckpointError: bad\n"
    assert startup_error_in(status_message) == "CheckpointError: bad"
    assert startup_error_in("RuntimeError: ASGI lifespan startup failed") is None
