"""What `pip install splitserve` (no extras) gives a user serves every checkpoint format the
docs/FEATURES.md lists (Quantization). A fresh venv gets the built wheel with its dependencies
only (no extras; tests/helpers/wheel.py); its `splitserve serve`, started outside the
repository, serves a plain checkpoint,
compressed-tensors FP8_DYNAMIC, W8A16 and W4A16 (what llm-compressor writes) and an HF fp8 one
side by side, and each answers a completion through the openai client with the text this
checkout's engine gives. A module the loader imports that only an extra installs fails here,
as it fails for users. The checkpoints are written by this process (the test extras have
compressed-tensors' writers and transformers); the venv only reads them."""

from __future__ import annotations

import subprocess

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.proto.messages.sampling_params import SamplingParams
from tests.helpers.compressed_checkpoint import write_compressed_checkpoint, write_hf_fp8_checkpoint
from tests.helpers.model import make_checkpoint
from tests.helpers.serve_process import ServeProcess

# ~50 s on 2 cores: the fresh venv (~10 s), then one serve of all five models (~40 s). slow keeps it
# out of `make test-e2e`; `make test` (CI) runs it.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]
PROMPT = "Once upon a time"
MAX_TOKENS = 8
MAX_MODEL_LEN = 256
# served model name -> how its checkpoint is written from the plain one (the `small` preset: its
# projections' input sizes are multiples of W4A16's 128-wide groups).
FORMATS = {
    "plain": lambda source, root: source,
    "ct-fp8-dynamic": lambda source, root: write_compressed_checkpoint(source, root / "fp8", "FP8_DYNAMIC"),
    "ct-w8a16": lambda source, root: write_compressed_checkpoint(source, root / "w8a16", "W8A16"),
    "ct-w4a16": lambda source, root: write_compressed_checkpoint(source, root / "w4a16", "W4A16"),
    "hf-fp8": lambda source, root: write_hf_fp8_checkpoint(source, root / "hf-fp8"),
}


@pytest.fixture(scope="module")
def venv(fresh_venv):
    """tests/helpers/wheel.py's install_in_fresh_venv, built in the background from the serial
    group's first test on (tests/conftest.py)."""
    return fresh_venv


@pytest.fixture(scope="module")
def checkpoints(models_root, tmp_path_factory):
    source = make_checkpoint(models_root, "small", "llama")
    root = tmp_path_factory.mktemp("formats")
    return {name: write(source, root) for name, write in FORMATS.items()}


@pytest.fixture(scope="module")
def server(venv, checkpoints, tmp_path_factory):
    models = [arg for name, path in checkpoints.items() for arg in ("--model", str(path), "--served-model-name", name)]
    proc = ServeProcess(
        None,
        tmp_path_factory.mktemp("serve") / "serve.log",
        *models,
        # One decode replica per model, prefilling locally: five models on 2 cores.
        "--prefill.replicas",
        "0",
        "--decode.resources.num-cpus",
        "0",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        python=venv.python,
        env=venv.env(),
        console_script=venv.bin / "splitserve",
        startup_timeout_s=400,
    )
    yield proc
    assert proc.stop() == 0, proc.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=300, max_retries=0)


def test_the_venv_has_the_wheel_and_no_extras(venv, tmp_path):
    probe = (
        "import importlib.util as u, splitserve.engine as e; "
        "print(e.__file__); print([m for m in ('pytest', 'openai', 'hypothesis') if u.find_spec(m)])"
    )
    res = subprocess.run(
        [str(venv.python), "-c", probe], cwd=tmp_path, env=venv.env(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    where, extras = res.stdout.splitlines()
    assert where.startswith(str(venv.root)) and extras == "[]", res.stdout


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_checkpoint_format_serves_a_completion(client, checkpoints, name):
    engine = LLMEngine(EngineConfig(model=str(checkpoints[name]), num_kv_blocks=64, max_model_len=MAX_MODEL_LEN))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (expected,) = engine.generate([PROMPT], params)
    res = client.completions.create(
        model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert res.model == name and res.usage.completion_tokens == MAX_TOKENS
    assert res.choices[0].text == expected.text
