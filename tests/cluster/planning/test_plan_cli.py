"""`splitserve plan`: the winner as a ServeConfig snippet the real loader accepts, the
runners-up table, and one-line answers to bad input."""

from __future__ import annotations

import json

import pytest
import yaml

from splitserve.bench.loadgen.trace_workload import load_mooncake_trace
from splitserve.cluster.cli.main import build_parser, main
from splitserve.cluster.cli.serve_flags import config_from_args
from splitserve.cluster.planning.workload import LengthDistribution, Workload
from splitserve.engine.config import ConfigError

DISAGGREGATED = ["--rate", "4", "--input-len", "4096", "--output-len", "512", "--percentile", "99"]
SLOS = ["--ttft-slo", "1000", "--itl-slo", "15", "--num-requests", "300"]


def plan(*args: str) -> list[str]:
    return ["plan", "--profile", "llama-8b-h200", *args]


def test_the_winner_is_a_serve_config_the_loader_accepts(tmp_path, capsys):
    snippet_file = tmp_path / "plan.yaml"
    assert main(plan(*DISAGGREGATED, *SLOS, "--out", str(snippet_file))) == 0
    out = capsys.readouterr().out
    assert "# the fewest GPUs: 2 (1P+1D" in out
    config = config_from_args(build_parser().parse_args(["serve", "--config", str(snippet_file)]))
    assert config.prefill.replicas == 1 and config.decode.replicas == 1
    assert config.decode.resources.num_gpus == 1 and config.prefill.max_num_batched_tokens in (512, 2048, 8192)
    assert yaml.safe_load(snippet_file.read_text()) == yaml.safe_load(out.split("\n", 2)[2].split("  GPUs")[0])
    table = out.split("  GPUs", 1)[1].splitlines()
    assert "TTFT p99" in table[0] and table[1].startswith("*") and len(table) > 3  # the winner, then runners-up
    assert any("colocated" in row and row.rstrip().endswith("no") for row in table[1:])


def test_a_colocated_winner_sets_no_prefill_pool(tmp_path, capsys):
    snippet_file = tmp_path / "plan.yaml"
    args = ["--rate", "2", "--input-len", "256", "--output-len", "1024", "--ttft-slo", "200", "--itl-slo", "20"]
    assert main(plan(*args, "--num-requests", "200", "--out", str(snippet_file))) == 0
    config = config_from_args(build_parser().parse_args(["serve", "--config", str(snippet_file)]))
    assert config.prefill.replicas == 0 and config.decode.replicas == 1


def test_an_unmeetable_slo_is_an_answer_not_a_crash(capsys):
    args = ["--rate", "2", "--input-len", "2048", "--output-len", "64", "--ttft-slo", "50", "--itl-slo", "50"]
    assert main(plan(*args, "--num-requests", "100", "--gpus", "2", "--tensor-parallel-sizes", "1")) == 1
    out = capsys.readouterr().out
    assert "no configuration of up to 2 GPUs meets TTFT p90 <= 50 ms; the best is " in out
    assert "GPUs  configuration" in out


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("splitserve plan: ")
    return err


def test_a_tensor_parallel_winner_sets_its_pools_tp_size(tmp_path, capsys):
    """TTFT p90 <= 50 ms on 2048-token prompts needs TP 2 (one H200 prefills them in ~68 ms):
    the snippet's pool is TP 2, one GPU per rank, and the loader accepts it."""
    snippet_file = tmp_path / "plan.yaml"
    args = ["--rate", "2", "--input-len", "2048", "--output-len", "64", "--ttft-slo", "50", "--itl-slo", "50"]
    assert main(plan(*args, "--num-requests", "100", "--gpus", "2", "--out", str(snippet_file))) == 0
    assert "(TP 2)" in capsys.readouterr().out
    config = config_from_args(build_parser().parse_args(["serve", "--config", str(snippet_file)]))
    pools = [config.decode] if config.prefill.replicas == 0 else [config.prefill, config.decode]
    assert max(pool.tensor_parallel_size for pool in pools) == 2
    assert sum(pool.replicas * pool.tensor_parallel_size for pool in pools) == 2
    assert all(pool.resources.num_gpus == 1 for pool in pools)
    bad = plan(*args, "--tensor-parallel-sizes", "1,8")
    assert "no figures for tensor_parallel_size 8 (it has 1, 2, 4)" in one_line_error(capsys, bad)


def test_bad_input_is_a_one_line_error(tmp_path, capsys, tiny_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert "has no requests" in one_line_error(capsys, plan("--trace", str(empty), *SLOS))
    assert "is for another model" in one_line_error(capsys, plan("--model", tiny_model, *DISAGGREGATED, *SLOS))
    unknown = ["plan", "--profile", "llama-9b-h300", *DISAGGREGATED, *SLOS]
    assert "neither a file nor a shipped one" in one_line_error(capsys, unknown)
    assert "--input-len" in one_line_error(capsys, plan("--rate", "1", "--input-len", "10+-20", *SLOS))
    assert "give a workload" in one_line_error(capsys, plan(*SLOS))


def test_help_names_every_input(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    for flag in ("--profile", "--trace", "--rate", "--input-len", "--output-len", "--ttft-slo", "--itl-slo"):
        assert flag in text
    assert "--percentile" in text and "--gpus" in text and "mean+-spread" in text


def test_lengths_and_a_trace_read_as_the_benchmark_reads_them(tmp_path):
    assert LengthDistribution.parse("512", "x") == LengthDistribution(512, 0)
    assert (
        LengthDistribution.parse("512+-128", "x")
        == LengthDistribution.parse("512 ± 128", "x")
        == LengthDistribution(512, 128)
    )
    with pytest.raises(ConfigError):
        LengthDistribution.parse("a lot", "x")
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000 + 250 * i, "input_length": 100 + i, "output_length": 10 + i, "hash_ids": [i]}
        for i in range(5)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workload = Workload.from_trace(trace)
    records = load_mooncake_trace(trace)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in workload.requests] == [
        ((x.timestamp_ms - 1000) / 1000, x.input_length, x.output_length) for x in records
    ]
    assert workload.rate == pytest.approx(4.0)


def test_a_trace_is_planned_from_its_own_arrivals(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 1024, "output_length": 64} for i in range(100)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(plan("--trace", str(trace), "--ttft-slo", "500", "--itl-slo", "30")) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("# trace trace.jsonl (100 requests); profile llama-8b-h200;") and "# the fewest GPUs: 1 " in out
    )
