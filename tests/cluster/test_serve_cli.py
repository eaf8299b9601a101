"""`splitserve serve`'s command line: every ServeConfig field is a flag (derived, round-trips),
the short forms, MODEL, --config / env / flag precedence, and one-line errors for bad flags
(no Ray here; the start-up errors are in test_serve_startup_errors.py)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import typing

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from splitserve.cluster.cli.main import build_parser, main
from splitserve.cluster.cli.serve_flags import SHORT_FORMS, config_from_args, flag_for, leaf_fields
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.default_model import DEFAULT_MODEL_NAME
from splitserve.cluster.model_entry_config import ModelEntryConfig
from splitserve.cluster.model_route_config import ModelRouteConfig, RouteRule
from splitserve.cluster.tenants.tenant_config import TenantConfig


@functools.cache
def _parser():
    """One parser for every parse (argparse's parse_args keeps no state between calls): building
    it derives ~100 flags from ServeConfig, ~60 ms, which this file would pay ~170 times."""
    return build_parser()


def parse(*argv: str, environ: dict | None = None) -> ServeConfig:
    return config_from_args(_parser().parse_args(["serve", *argv]), environ=environ or {})


def get(cfg: BaseModel, path: str):
    for key in path.split("."):
        cfg = getattr(cfg, key)
    return cfg


def _candidates(annotation, default) -> list:
    """Values of a field's type other than its default, most likely valid first."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return list(args)
    if args and typing.get_origin(annotation) is not dict:  # Optional[X]
        return _candidates(args[0], default)
    if annotation is bool:
        return [not default]
    if annotation is int:
        return [(default or 1) * 2, 7, 0, 1, 2]
    if annotation is float:
        return [(default or 1.0) * 2, (default or 1.0) / 2, 0.5, 0.0]
    if annotation is str:
        return ["some-value", "sqlite:///some-value"]  # the second: a field that wants a database URL
    if typing.get_origin(annotation) is dict:
        return [{"accelerator_x": 2.0}]
    raise AssertionError(f"no test value for {annotation}")


# Fields that must hold one value together (ServeConfig refuses them apart): each is tried
# with its partner set to the same value.
# Fields whose type (str) says too little: a value their own validator accepts.
KNOWN_VALID = {
    # "ingress" (the Literal's first non-default) needs one ingress replica; all at once has two
    "http_listener": "haproxy",
    "state_url": "sqlite:////tmp/splitserve-cli-test/state.db",
    # the sla policy's profile is loaded when both pools autoscale on it (as they do all at once)
    "planner.profile": "llama-8b-h200",
    "lora_modules": {"sql": "/adapters/sql"},
    # every field spelled out, as ServeConfig dumps it, so the round trip compares like with like
    "tenants": [TenantConfig(name="acme", api_keys=["sk-acme-test"], requests_per_minute=60).model_dump()],
    # an entry's pool settings dump as given (only the keys set), which the round trip keeps
    "models": [
        ModelEntryConfig.model_validate(m).model_dump()
        for m in (
            {"model": "/m/small", "served_model_name": DEFAULT_MODEL_NAME, "decode": {"replicas": 2}},
            {"model": "/m/large", "served_model_name": "big"},
        )
    ],
    # Aliases and routes name a served model: the default model's name is one alone (no models
    # list) and with every field set at once (the models list serves it too).
    "aliases": {"latest": DEFAULT_MODEL_NAME},
    "model_routes": [
        ModelRouteConfig(
            name="auto", policy="rules", default=DEFAULT_MODEL_NAME, rules=[RouteRule(target=DEFAULT_MODEL_NAME)]
        ).model_dump()
    ],
}
AGREEING = {
    "prefill.kv_cache_dtype": "decode.kv_cache_dtype",
    "decode.kv_cache_dtype": "prefill.kv_cache_dtype",
    "prefill.tensor_parallel_size": "decode.tensor_parallel_size",
    "decode.tensor_parallel_size": "prefill.tensor_parallel_size",
}
# Fields valid away from their default only with other fields at a given value: TP > 1 serves
# without a prefill pool, LoRA without several models. They are round-tripped one by one (with these set too), not in the
# all-at-once check, where the other fields hold their own non-default values (prefill replicas 2).
NEEDS: dict[str, dict[str, object]] = {
    "prefill.tensor_parallel_size": {"prefill.replicas": 0},
    "decode.tensor_parallel_size": {"prefill.replicas": 0},
    # LoRA serves one base model (not the all-at-once `models` list); adapters need enable_lora.
    "enable_lora": {},
    "lora_modules": {"enable_lora": True},
}


def non_default_values() -> dict[str, object]:
    """{path: a valid value != its default} for every ServeConfig leaf field."""
    values = {}
    for path, info in leaf_fields().items():
        default = info.get_default(call_default_factory=True)
        candidates = [KNOWN_VALID[path]] if path in KNOWN_VALID else _candidates(info.annotation, default)
        for value in candidates:
            raw: dict = {}
            settings = {path: value, AGREEING.get(path, path): value, **NEEDS.get(path, {})}
            for target, setting in settings.items():
                node = raw
                *parents, leaf = target.split(".")
                for key in parents:
                    node = node.setdefault(key, {})
                node[leaf] = setting
            if value == default:
                continue
            try:
                ServeConfig.model_validate(raw)
            except ValidationError:
                continue
            values[path] = value
            break
        assert path in values, f"no valid non-default value found for {path}"
    return values


def plain(value):
    """A field's value as non_default_values spells it (a list of models as their dumps)."""
    return (
        [v.model_dump() for v in value]
        if isinstance(value, list) and value and hasattr(value[0], "model_dump")
        else value
    )


def flag_args(path: str, value) -> list[str]:
    if isinstance(value, bool):
        return [flag_for(path) if value else "--no-" + flag_for(path)[2:]]
    return [flag_for(path), json.dumps(value) if isinstance(value, dict | list) else str(value)]


def test_every_leaf_field_is_a_flag_that_round_trips():
    values = non_default_values()
    assert len(values) == len(leaf_fields()) > 50
    for path, value in values.items():
        settings = {path: value, AGREEING.get(path, path): value, **NEEDS.get(path, {})}
        cfg = parse(*[arg for target, setting in settings.items() for arg in flag_args(target, setting)])
        assert plain(get(cfg, path)) == value, path
        # Nothing else moved: the flag set exactly its own field (and its partner's).
        expected = ServeConfig().model_dump()
        for target, setting in settings.items():
            expected = _with(expected, target, setting)
        assert cfg.model_dump() == expected, path
    # All at once, and back through --print-config's YAML as a --config file.
    argv = all_at_once_args(values)
    everything = parse(*argv)
    for path, value in values.items():
        if path not in NEEDS:
            assert plain(get(everything, path)) == value, path


def all_at_once_args(values: dict[str, object]) -> list[str]:
    return [arg for path, value in values.items() if path not in NEEDS for arg in flag_args(path, value)]


def _with(tree: dict, path: str, value) -> dict:
    *parents, leaf = path.split(".")
    node = tree
    for key in parents:
        node = node[key]
    node[leaf] = value
    return tree


def test_help_lists_every_field_with_its_description(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for path, info in leaf_fields().items():
        assert info.description, f"{path} has no docstring: it is the flag's help"
        assert f"{flag_for(path)} " in text or f"{flag_for(path)}," in text, path
        assert " ".join(info.description.split()) in text, path


def test_print_config_round_trips_through_config_file(tmp_path, capsys):
    argv = all_at_once_args(non_default_values())
    assert main(["serve", *argv, "--print-config"]) == 0
    printed = capsys.readouterr().out
    path = tmp_path / "serve.yaml"
    path.write_text(printed)
    assert parse("--config", str(path)) == parse(*argv)


def test_short_forms_and_model_positional():
    cfg = parse(
        "some/model",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--router",
        "random",
        "--max-num-seqs",
        "8",
        "--prefill-replicas",
        "2",
        "--decode-max-replicas",
        "3",
        "--decode-resources",
        '{"decode_gpu": 1}',
        "--local-prefill-threshold",
        "5",
        "--ingress-replicas",
        "3",
    )
    assert cfg.model == "some/model" and cfg.model_id == "some/model"
    assert (cfg.http_host, cfg.http_port, cfg.router.policy) == ("0.0.0.0", 9000, "random")
    assert cfg.prefill.max_num_seqs == cfg.decode.max_num_seqs == 8 and cfg.prefill.replicas == 2
    assert cfg.decode.autoscaling.max_replicas == 3 and cfg.decode.autoscaling.enabled
    assert cfg.decode.resources.resources == {"decode_gpu": 1} and cfg.router.local_prefill_threshold == 5
    assert cfg.ingress.replicas == 3 and not cfg.ingress.autoscaling.enabled
    scaled = parse("m", "--ingress-max-replicas", "4", "--ingress.autoscaling.target-ongoing-requests", "8")
    assert scaled.ingress.autoscaling.enabled and scaled.ingress.autoscaling.max_replicas == 4
    assert scaled.ingress.autoscaling.target_ongoing_requests == 8
    assert parse("m", "--served-model-name", "alias").model_id == "alias"
    for flag, short in SHORT_FORMS.items():  # each names real fields
        assert all(path in leaf_fields() for path in (*short.paths, *short.implies)), flag


def test_precedence_config_file_then_env_then_flags(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"http_port": 7000, "api_key": "from-file", "prefill": {"replicas": 3}}))
    cfg = parse("--config", str(path))
    assert (cfg.http_port, cfg.api_key, cfg.prefill.replicas) == (7000, "from-file", 3)
    cfg = parse("--config", str(path), environ={"SPLITSERVE_API_KEY": "from-env"})
    assert cfg.api_key == "from-env"
    cfg = parse("--config", str(path), "--api-key", "from-flag", "--port", "7001", environ={"SPLITSERVE_API_KEY": "e"})
    assert (cfg.api_key, cfg.http_port, cfg.prefill.replicas) == ("from-flag", 7001, 3)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["a", "--model", "b"], "MODEL and --model disagree"),
        (["--port", "1", "--http-port", "2"], "--port and --http-port disagree"),
        (["--prefill-replicas", "-1"], "--prefill.replicas: Input should be greater than or equal to 0"),
        (["--decode-resources", "{x"], "--decode-resources must be a JSON object"),
        (["--prefill.autoscaling.min-replicas", "5"], "min_replicas must be <= max_replicas"),
        (["--block-size", "12"], "power of two"),
        (["--prefill.kv-cache-dtype", "fp8"], "both pools must use one KV-cache dtype"),
        (["--config", "/no/such.yaml"], "cannot read --config /no/such.yaml"),
    ],
)
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(["serve", *argv, "--print-config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve serve: error: ") and message in err and err.count("\n") == 1, err


def test_unknown_flag_prints_the_serve_usage():
    res = subprocess.run(
        [sys.executable, "-m", "splitserve.cluster.cli", "serve", "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert (
        res.stderr.startswith("usage: splitserve serve [MODEL]")
        and "unrecognized arguments: --no-such-flag" in res.stderr
    )
