"""`splitserve profile` on the tiny model, TP 1 and 2 (gloo, two ranks): the file it writes is a
profile that `splitserve plan` plans with and a simulated TP-2 replica steps by, carrying the
model's KV bytes per token; bad sizes are a one-line error."""

from __future__ import annotations

from splitserve.cluster.cli.main import main
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_factory import build_engine
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.simulated.simulated_kv_cache import kv_bytes_per_token
from splitserve.engine.simulated.step_time_profile import StepTimeProfile


def test_a_profile_measured_here_is_read_by_plan_and_the_simulated_engine(tiny_model, tmp_path, capsys):
    out = tmp_path / "tiny-here.yaml"
    argv = ["profile", "--model", tiny_model, "--out", str(out), "--reps", "1", "--tensor-parallel-sizes", "1,2"]
    assert main(argv) == 0
    profile = StepTimeProfile.load(str(out))
    assert profile.name == "tiny-here" and profile.tensor_parallel_sizes == [1, 2]
    assert profile.kv_bytes_per_token == kv_bytes_per_token(ModelConfig.from_pretrained(tiny_model), None)
    tp2 = profile.for_tensor_parallel(2)
    assert tp2.step_overhead_s + tp2.token_compute_s + tp2.context_token_s > 0  # measured, not copied
    assert tp2.step_overhead_s != profile.step_overhead_s or tp2.token_compute_s != profile.token_compute_s
    slos = ["--ttft-slo", "100000", "--itl-slo", "100000", "--num-requests", "50", "--gpus", "2"]
    assert main(["plan", "--profile", str(out), "--rate", "1", "--input-len", "64", "--output-len", "8", *slos]) == 0
    assert "# the fewest GPUs: 1" in capsys.readouterr().out
    engine = build_engine(EngineConfig(model=tiny_model, engine="simulated", profile=str(out), tensor_parallel_size=2))
    assert engine.profile.step_overhead_s == tp2.step_overhead_s


def test_bad_sizes_are_a_one_line_error(tiny_model, tmp_path, capsys):
    out = tmp_path / "p.yaml"
    assert main(["profile", "--model", tiny_model, "--out", str(out), "--tensor-parallel-sizes", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("splitserve profile: ") and not out.exists()
