"""KV-cache settings in ServeConfig and its flags: kv_cache_dtype per pool (and the
--kv-cache-dtype short form for both), refused when the pools disagree."""

from __future__ import annotations

import pytest

from splitserve.cluster.cli.main import build_parser
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
