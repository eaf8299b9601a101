"""tensor_parallel_size per pool in ServeConfig: --tensor-parallel-size sets both pools, so does
YAML, it reaches each pool's engines, the two pools may differ (KV moves between the sizes,
kvtransfer/head_map.py), and what cannot work is a one-line start-up error naming the numbers
(prefill and decode sizes that cannot share the KV heads, a size that does not split the
model's heads)."""

from __future__ import annotations

import os

import pytest

from splitserve.cluster.cli.main import build_parser, main
from splitserve.cluster.cli.serve_flags import ServeFlagsError, config_from_args
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.worker_pool import engine_config_for
from splitserve.engine.config import EngineConfig

pytestmark = pytest.mark.unit


def parse(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", *argv]), environ={})


def test_the_short_form_sets_both_pools_and_reaches_their_engines(tmp_path):
    assert parse().prefill.tensor_parallel_size == parse().decode.tensor_parallel_size == 1
    cfg = parse("--tensor-parallel-size", "2", "--prefill-replicas", "0")
    for pool in (cfg.prefill, cfg.decode):
        assert pool.tensor_parallel_size == 2
        assert EngineConfig(**engine_config_for(cfg, pool, "m")).tensor_parallel_size == 2
    path = tmp_path / "serve.yaml"
    path.write_text("prefill: {tensor_parallel_size: 4, replicas: 0}\ndecode: {tensor_parallel_size: 4}\n")
    assert parse("--config", str(path)).decode.tensor_parallel_size == 4
    with pytest.raises(
        ServeFlagsError, match="--prefill.tensor-parallel-size: Input should be greater than or equal to 1"
    ):
        parse("--tensor-parallel-size", "0")


def test_pools_of_different_tp_sizes_serve_side_by_side_with_a_prefill_pool():
    for prefill, decode in ((2, 1), (1, 2), (2, 2), (4, 2)):
        cfg = parse("--prefill.tensor-parallel-size", str(prefill), "--decode.tensor-parallel-size", str(decode))
        assert cfg.prefill.replicas >= 1
        assert EngineConfig(**engine_config_for(cfg, cfg.prefill, "m")).tensor_parallel_size == prefill
        assert EngineConfig(**engine_config_for(cfg, cfg.decode, "m")).tensor_parallel_size == decode


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ("--tensor-parallel-size", "3", "--prefill-replicas", "0"),
            "prefill: tensor_parallel_size 3 does not divide num_attention_heads",
        ),
        (
            ("--prefill.tensor-parallel-size", "2", "--decode.tensor-parallel-size", "3"),
            "prefill tensor_parallel_size 2 and decode tensor_parallel_size 3 cannot map the model's 2 KV heads: "
            "the decode size 3 neither divides 2 nor is a multiple of it",
        ),
        (
            ("--tensor-parallel-size", "2", "--prefill-replicas", "0", "--quantization", "int4"),
            "prefill: int4 quantization groups of 64 inputs cannot be split over tensor_parallel_size 2: "
            "o_proj has 64 inputs, 32 per rank",
        ),
    ],
)
def test_a_size_the_model_cannot_take_stops_serve_before_ray_starts(tiny_model, capsys, monkeypatch, flags, expected):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # run_serve sets Ray's env vars first
    assert main(["serve", tiny_model, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitserve serve: error: {expected}") and err.count("\n") == 1
