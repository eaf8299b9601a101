"""KV-cache settings in ServeConfig and its flags: kv_cache_dtype per pool (and the
--kv-cache-dtype short form for both), refused when the pools disagree; kv_cache_memory_bytes
per pool, with size suffixes, and a budget too small for one sequence refused at start-up."""

from __future__ import annotations

import os

import pytest

from splitserve.cluster.cli.main import build_parser, main
from splitserve.cluster.cli.serve_flags import ServeFlagsError, config_from_args
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.worker_pool import engine_config_for
from splitserve.engine.config import EngineConfig


def parse(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]), environ={})


def test_kv_cache_dtype_short_form_sets_both_pools_and_reaches_the_engines():
    cfg = parse("--kv-cache-dtype", "fp8")
    assert cfg.prefill.kv_cache_dtype == cfg.decode.kv_cache_dtype == "fp8"
    for pool in (cfg.prefill, cfg.decode):
        engine = EngineConfig(**engine_config_for(cfg, pool, "m"))
        assert engine.kv_cache_dtype == "fp8"
    assert parse().decode.kv_cache_dtype == "auto"


def test_kv_cache_dtype_from_yaml_and_unknown_values(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("prefill: {kv_cache_dtype: int8}\ndecode: {kv_cache_dtype: int8}\n")
    assert parse("--config", str(path)).decode.kv_cache_dtype == "int8"
    with pytest.raises(ServeFlagsError, match="--decode.kv-cache-dtype: Input should be 'auto', 'fp8' or 'int8'"):
        parse("--decode.kv-cache-dtype", "fp4")


def test_pools_that_disagree_on_the_kv_dtype_are_refused():
    with pytest.raises(ServeFlagsError, match="prefill.kv_cache_dtype 'auto' and decode.kv_cache_dtype 'fp8' differ"):
        parse("--decode.kv-cache-dtype", "fp8")
    with pytest.raises(ValueError, match="both pools must use one KV-cache dtype"):
        ServeConfig.model_validate({"prefill": {"kv_cache_dtype": "int8"}, "decode": {"kv_cache_dtype": "fp8"}})


def test_kv_cache_memory_bytes_per_pool_takes_sizes(tmp_path):
    cfg = parse("--prefill.kv-cache-memory-bytes", "512Mi", "--decode.kv-cache-memory-bytes", "2G")
    assert (cfg.prefill.kv_cache_memory_bytes, cfg.decode.kv_cache_memory_bytes) == (512 * 2**20, 2 * 10**9)
    assert EngineConfig(**engine_config_for(cfg, cfg.decode, "m")).kv_cache_memory_bytes == 2 * 10**9
    path = tmp_path / "serve.yaml"
    path.write_text("decode: {kv_cache_memory_bytes: 4Gi}\n")
    assert parse("--config", str(path)).decode.kv_cache_memory_bytes == 4 * 2**30
    assert parse().decode.kv_cache_memory_bytes is None
    for bad in ("-1", "lots", "0"):
        with pytest.raises(ServeFlagsError, match="--decode.kv-cache-memory-bytes: kv_cache_memory_bytes must be"):
            parse("--decode.kv-cache-memory-bytes", bad)


def test_a_kv_budget_too_small_for_one_sequence_stops_serve_before_ray_starts(tiny_model, capsys, monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # run_serve sets Ray's env vars first
    assert main(["serve", tiny_model, "--kv-cache-dtype", "fp8", "--decode.kv-cache-memory-bytes", "10Ki"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve serve: error: decode: kv_cache_memory_bytes 10240 holds") and err.count("\n") == 1
    assert "one 1024-token sequence needs 64 blocks" in err
