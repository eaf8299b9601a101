"""bench/engine/engine_throughput.py end to end on the tiny model, with a stand-in `vllm` package that
wraps splitserve's own engine, so the subprocess protocol, the ratios and the output agreement
are checked without vLLM installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from splitserve.bench.engine.engine_throughput import main
from splitserve.bench.engine.engine_throughput_report import KEPT_SECTION, write_report
from splitserve.bench.engine.vllm_engine_process import VllmProcessError

REPO_ROOT = Path(__file__).resolve().parents[2]

FAKE_VLLM = '''
"""Stand-in for vllm: the same offline API, backed by splitserve's LLMEngine."""
from types import SimpleNamespace

__version__ = "0.0-fake"
print("INFO fake vllm imported: log noise on stdout", flush=True)


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.kwargs = dict(temperature=temperature, max_tokens=max_tokens, ignore_eos=ignore_eos)


class LLM:
    def __init__(self, model, dtype, max_num_seqs, max_num_batched_tokens, max_model_len, seed,
                 enforce_eager):
        if FAIL:
            raise RuntimeError("fake vllm refuses to start")
        from splitserve.engine.config import EngineConfig
        from splitserve.engine.llm_engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(
            model=model, dtype=dtype, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, seed=seed))

    def generate(self, prompts, params, use_tqdm):
        from splitserve.proto.messages.sampling_params import SamplingParams as Params

        print("INFO generating", len(prompts), flush=True)
        outs = self.engine.generate([p["prompt_token_ids"] for p in prompts], Params(**params.kwargs))
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=o.token_ids)]) for o in outs]
'''


def fake_vllm_env(tmp_path: Path, monkeypatch, fail: bool = False) -> None:
    package = tmp_path / "fake_site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(f"FAIL = {fail}\n" + textwrap.dedent(FAKE_VLLM))
    monkeypatch.setenv("PYTHONPATH", f"{package.parent}:{REPO_ROOT}")


def test_report_with_stand_in_vllm(tiny_model, tmp_path, monkeypatch):
    fake_vllm_env(tmp_path, monkeypatch)
    out = tmp_path / "throughput.md"
    assert (
        main(
            [
                "--model",
                tiny_model,
                "--vllm-python",
                sys.executable,
                "--batch-sizes",
                "1,2",
                "--max-tokens",
                "4",
                "--repeats",
                "2",
                "--out",
                str(out),
                "--profile",
            ]
        )
        == 0
    )
    text = out.read_text()
    assert "vLLM 0.0-fake" in text
    for batch in (1, 2):
        row = next(line for line in text.splitlines() if line.startswith(f"| {batch} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 7 and cells[3].startswith("**") and cells[3].endswith("x**")
        assert float(cells[1].replace(",", "")) > 0 and float(cells[2].replace(",", "")) > 0
        # The stand-in runs the same engine, so greedy outputs must agree exactly.
        assert f"batch {batch}: {2 * batch}/{2 * batch} sequences identical" in text
    best_rows = [line for line in text.splitlines() if line.startswith("| 2 |")]
    assert len(best_rows) == 2 and best_rows[1].count("x |") >= 1  # best ratio (CPU ratio needs psutil)
    assert "--batch-sizes 1,2" in text
    assert "CPU ms/step" in text and "torch.profiler, batch 2" in text
    log = out.with_suffix(".vllm.log").read_text()
    assert "INFO generating" in log  # stdout noise went to the log, not into the results


def test_vllm_that_fails_to_start_names_its_log(tiny_model, tmp_path, monkeypatch):
    fake_vllm_env(tmp_path, monkeypatch, fail=True)
    out = tmp_path / "throughput.md"
    with pytest.raises(VllmProcessError, match="exited .* during start; see .*vllm.log"):
        main(
            [
                "--model",
                tiny_model,
                "--vllm-python",
                sys.executable,
                "--batch-sizes",
                "1",
                "--max-tokens",
                "2",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
    assert "fake vllm refuses to start" in out.with_suffix(".vllm.log").read_text()
    assert not out.exists()


def test_missing_vllm_python_is_reported(tiny_model, tmp_path):
    with pytest.raises(VllmProcessError, match="no python interpreter"):
        main(
            [
                "--model",
                tiny_model,
                "--vllm-python",
                str(tmp_path / "nope" / "python"),
                "--batch-sizes",
                "1",
                "--max-tokens",
                "2",
                "--repeats",
                "1",
                "--out",
                str(tmp_path / "r.md"),
            ]
        )


def test_rerun_keeps_the_hand_written_analysis(tmp_path):
    out = tmp_path / "r.md"
    out.write_text(f"# old table\n\n{KEPT_SECTION}\n\nwhy we are slow\n")
    write_report(out, "# new table\n")
    assert out.read_text() == f"# new table\n\n{KEPT_SECTION}\n\nwhy we are slow\n"


@pytest.mark.parametrize("argv", [["--batch-sizes", "0"], ["--batch-sizes", "a,b"], ["--max-tokens", "1"]])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_help_runs_as_a_module():
    proc = subprocess.run(
        [sys.executable, "-m", "splitserve.bench.engine.engine_throughput", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--vllm-python" in proc.stdout
