"""LoRA settings of `splitserve serve` (vLLM's flags): --enable-lora, --lora-modules in vLLM's
`name=path ...` form (repeatable, or JSON), --max-loras, --max-lora-rank; what they cannot be
set to is a one-line error, and an adapter that cannot be served (a missing directory, a rank
above the limit, another base's shapes) is found before Ray starts."""

from __future__ import annotations

import os

import pytest
import transformers

from splitserve.cluster.cli import serve as serve_command
from splitserve.cluster.cli.main import build_parser, main
from splitserve.cluster.cli.serve_flags import config_from_args
from splitserve.cluster.control.worker_pool import engine_config_for
from tests.helpers.peft_adapters import write_peft_adapter
from tests.helpers.transformers_checkpoint import SERVABLE_SHAPE, write_transformers_checkpoint


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(["serve", *argv]), environ={})


def test_lora_flags_take_vllms_forms(capsys):
    cfg = parse("m", "--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "3")
    assert cfg.enable_lora and cfg.lora_modules == {"sql": "/a/sql", "chat": "/a/chat"} and cfg.max_loras == 3
    repeated = parse("m", "--enable-lora", "--lora-modules", "sql=/a/sql", "--lora-modules", "chat=/a/chat")
    assert repeated.lora_modules == cfg.lora_modules
    vllm_json = parse("m", "--enable-lora", "--lora-modules", '{"name": "sql", "path": "/a/sql"}')
    assert vllm_json.lora_modules == {"sql": "/a/sql"}
    assert parse("m", "--enable-lora", "--max-lora-rank", "64").max_lora_rank == 64
    # More adapters than slots: the host cache's size passes to every engine (unset: max_loras).
    many = parse("m", "--enable-lora", "--lora-modules", "a=/a", "b=/b", "c=/c", "--max-loras", "1")
    assert many.max_cpu_loras is None and engine_config_for(many, many.decode, "m")["max_cpu_loras"] is None
    cached = parse("m", "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "8")
    assert all(engine_config_for(cached, pool, "m")["max_cpu_loras"] == 8 for pool in (cached.prefill, cached.decode))
    with pytest.raises(SystemExit):  # argparse's own error: the usage, then the line
        parse("m", "--enable-lora", "--lora-modules", "sql")
    assert "argument --lora-modules: expected NAME=PATH (an adapter's name and its directory), got 'sql'" in (
        capsys.readouterr().err
    )
    # Both pools' engines get the adapters: prefill computes the prompt's KV with them too.
    for pool in (cfg.prefill, cfg.decode):
        engine = engine_config_for(cfg, pool, "m")
        assert engine["enable_lora"] and engine["lora_modules"] == cfg.lora_modules and engine["max_loras"] == 3


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-modules", "sql=/a"], "lora_modules needs enable_lora (--enable-lora)"),
        (["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "max_cpu_loras=1 is below max_loras=2"),
        (["--enable-lora", "--lora-modules", "m=/a"], "LoRA adapter 'm': the name is already the served model's"),
        (["--enable-lora", "--tensor-parallel-size", "2", "--prefill-replicas", "0"], "tensor_parallel_size > 1"),
        (["--enable-lora", "--max-lora-rank", "0"], "--max-lora-rank: Input should be greater than or equal to 1"),
    ],
)
def test_bad_lora_settings_are_one_line_errors(argv, message, capsys):
    assert main(["serve", "m", *argv, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve serve: error: ") and message in err and err.count("\n") == 1, err


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-preflight")
    base = root / "base"
    write_transformers_checkpoint(transformers.LlamaConfig(**SERVABLE_SHAPE), base, seed=3, tokenizer=True)
    other = root / "other-base"  # another shape: hidden 32
    write_transformers_checkpoint(
        transformers.LlamaConfig(**{**SERVABLE_SHAPE, "hidden_size": 32}), other, seed=4, tokenizer=True
    )
    return base, {
        "rank32": write_peft_adapter(base, root / "rank32", 1, 32, 16, ["q_proj"]),
        "foreign": write_peft_adapter(other, root / "foreign", 2, 4, 8, ["q_proj"]),
    }


@pytest.mark.parametrize(
    "adapter, message",
    [
        ("missing", "LoRA adapter 'x': {root}/missing is not a directory"),
        ("rank32", "LoRA adapter 'x': rank 32 is above max_lora_rank=16"),
        ("foreign", "the base model implies (4, 64) (an adapter for another base?)"),
    ],
)
def test_adapters_that_cannot_be_served_are_found_before_ray_starts(
    base_and_adapters, adapter, message, capsys, monkeypatch
):
    base, adapters = base_and_adapters
    monkeypatch.setattr(os, "environ", dict(os.environ))  # serve sets Ray's env vars first

    def start_ray(*args, **kwargs):
        raise AssertionError("serve went on to start Ray")

    monkeypatch.setattr(serve_command, "_serve", start_ray)
    path = adapters.get(adapter, base.parent / adapter)
    assert main(["serve", str(base), "--enable-lora", "--lora-modules", f"x={path}"]) == 2
    err = capsys.readouterr().err
    expected = message.format(root=base.parent)
    assert err.startswith("splitserve serve: error: ") and expected in err and err.count("\n") == 1, err
