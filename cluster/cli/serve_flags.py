"""The flags of `splitserve serve`, derived from ServeConfig, and the config they resolve to.

Every ServeConfig leaf field is a flag named after its path in kebab case (`--http-port`,
`--max-model-len`, `--prefill.num-kv-blocks`, `--decode.autoscaling.max-replicas`) with
the field's docstring as its help, so a new field needs no edit here. On top of those:

- `MODEL`, positional as in `vllm serve MODEL` (the same as --model);
- `--model` and `--served-model-name` given more than once: several models (`models`), paired
  by position;
- the short forms users know (SHORT_FORMS): `--host`/`--port` (vLLM's names for the HTTP
  address), `--prefill-replicas`, `--router`, `--local-prefill-threshold`, `--prefill-placement`, `--decode-max-replicas` (which also turns
  autoscaling on), `--max-num-seqs`, `--kv-cache-dtype` and `--tensor-parallel-size` (both pools), `--ingress-replicas`,
  `--ingress-max-replicas` (Serve autoscaling of the ingress) ...;
- `--config FILE.yaml` (ServeConfig fields; flags override it) and env SPLITSERVE_API_KEY
  (below --api-key, above the file).

Library: pydantic-settings' CliSettingsSource, attached to the existing `serve` argparse
subparser (root_parser=...). jsonargparse, tried too, brings its own ArgumentParser class
(no home under the argparse subcommands of `splitserve`, where `bench` registers itself),
snake_case flags only (`--http_port`, where vLLM users type `--max-model-len`), `{true,false}`
booleans, and a `--router CONFIG` group flag that takes the `--router kv` short form.
pydantic-settings gives kebab-case flags, `--flag/--no-flag` booleans, and only the values
given on the command line, which is what overriding the YAML file needs.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_settings import CliSettingsSource

from splitserve.cluster.config import ServeConfig

API_KEY_ENV = "SPLITSERVE_API_KEY"
SERVE_USAGE = "splitserve serve [MODEL] [options]"


@dataclass(frozen=True)
class ShortForm:
    """A flag that sets one value at one or more ServeConfig paths (and maybe fixed others)."""

    paths: tuple[str, ...]
    implies: dict[str, Any] = field(default_factory=dict)


def _pool_short_forms(pool: str) -> dict[str, ShortForm]:
    return {
        f"--{pool}-replicas": ShortForm((f"{pool}.replicas",)),
        f"--{pool}-num-cpus": ShortForm((f"{pool}.resources.num_cpus",)),
        f"--{pool}-num-gpus": ShortForm((f"{pool}.resources.num_gpus",)),
        f"--{pool}-resources": ShortForm((f"{pool}.resources.resources",)),
        f"--{pool}-num-kv-blocks": ShortForm((f"{pool}.num_kv_blocks",)),
        f"--{pool}-min-replicas": ShortForm((f"{pool}.autoscaling.min_replicas",)),
        f"--{pool}-max-replicas": ShortForm(
            (f"{pool}.autoscaling.max_replicas",), {f"{pool}.autoscaling.enabled": True}
        ),
    }


SHORT_FORMS: dict[str, ShortForm] = {
    "--host": ShortForm(("http_host",)),
    "--port": ShortForm(("http_port",)),
    "--router": ShortForm(("router.policy",)),
    "--local-prefill-threshold": ShortForm(("router.local_prefill_threshold",)),
    "--prefill-placement": ShortForm(("router.prefill_placement",)),
    "--max-num-seqs": ShortForm(("prefill.max_num_seqs", "decode.max_num_seqs")),
    "--kv-cache-dtype": ShortForm(("prefill.kv_cache_dtype", "decode.kv_cache_dtype")),
    "--tensor-parallel-size": ShortForm(("prefill.tensor_parallel_size", "decode.tensor_parallel_size")),
    "--ingress-replicas": ShortForm(("ingress.replicas",)),
    "--ingress-max-replicas": ShortForm(("ingress.autoscaling.max_replicas",), {"ingress.autoscaling.enabled": True}),
    **_pool_short_forms("prefill"),
    **_pool_short_forms("decode"),
}
_SHORT_DEST = "short_form:"  # namespace keys of the short forms: "short_form:--host"


class ServeFlagsError(ValueError):
    """Flags, a config file or an env var that do not make a valid ServeConfig."""


def leaf_fields(model: type[BaseModel] = ServeConfig, prefix: str = "") -> dict[str, Any]:
    """{dotted path: FieldInfo} of every leaf field (nested models descended into)."""
    leaves = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            leaves.update(leaf_fields(annotation, f"{prefix}{name}."))
        else:
            leaves[f"{prefix}{name}"] = info
    return leaves


def flag_for(path: str) -> str:
    """The flag of a ServeConfig field path: "prefill.num_kv_blocks" -> "--prefill.num-kv-blocks"."""
    return "--" + path.replace("_", "-")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """Add MODEL, one flag per ServeConfig leaf field and the short forms to `parser`."""
    parser.add_argument(
        "model_tag", nargs="?", metavar="MODEL", help="checkpoint directory, the same as --model (as in `vllm serve`)"
    )
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of ServeConfig fields; flags override it")
    source = CliSettingsSource(
        ServeConfig,
        root_parser=parser,
        cli_kebab_case=True,
        cli_implicit_flags=True,  # --layerwise-transfer / --no-layerwise-transfer
        cli_avoid_json=True,  # no `--router JSON` group flags: `--router kv` is a short form
        cli_hide_none_type=True,
    )
    fields = leaf_fields()
    shadowed = set(SHORT_FORMS) & {flag_for(path) for path in fields}
    if shadowed:  # the parser resolves conflicts by replacing: never let that hide a field
        raise ServeFlagsError(f"short forms {sorted(shadowed)} would hide ServeConfig fields")
    group = parser.add_argument_group("short forms")
    for flag, short in SHORT_FORMS.items():
        info = fields[short.paths[0]]
        targets = " and ".join(flag_for(p) for p in short.paths)
        implied = "".join(f"; sets {flag_for(p)}={json.dumps(v)}" for p, v in short.implies.items())
        group.add_argument(
            flag,
            dest=_SHORT_DEST + flag,
            default=argparse.SUPPRESS,
            choices=_choices(info.annotation),
            metavar=None if _choices(info.annotation) else flag.rsplit("-", 1)[-1].upper(),
            help=f"= {targets}{implied}",
        )
    for flag in REPEATABLE:  # given more than once: several models (see _models_from_repeats)
        parser._option_string_actions[flag].__class__ = _RepeatedStore
    adapters = parser._option_string_actions[LORA_MODULES]
    adapters.__class__, adapters.nargs, adapters.metavar = _AdapterList, "+", "NAME=PATH"
    parser.set_defaults(serve_flags=source)


# `--model A --model B [--served-model-name a --served-model-name b]`: one `models` entry per
# --model, paired with the --served-model-name at the same position.
REPEATABLE = ("--model", "--served-model-name")


class _RepeatedStore(argparse._StoreAction):
    """Stores the value, or the list of values when the flag is given again."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        if previous is None or previous is argparse.SUPPRESS:
            setattr(namespace, self.dest, values)
        else:
            setattr(namespace, self.dest, [*(previous if isinstance(previous, list) else [previous]), values])


# vLLM's `--lora-modules name=path [name=path ...]` (also repeated, or a JSON object).
LORA_MODULES = "--lora-modules"


class _AdapterList(argparse._StoreAction):
    """Stores every name=path given (all occurrences) as one JSON object, as the settings
    source reads a dict field. A JSON item is an object of names to paths, or vLLM's
    {"name": ..., "path": ...}."""

    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        adapters = json.loads(previous) if isinstance(previous, str) else {}
        for item in values:
            adapters.update(self._item(item))
        setattr(namespace, self.dest, json.dumps(adapters))

    def _item(self, item: str) -> dict[str, str]:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
            except json.JSONDecodeError as exc:
                raise argparse.ArgumentError(self, f"{item!r} is not valid JSON: {exc}") from None
            return {obj["name"]: obj["path"]} if isinstance(obj, dict) and {"name", "path"} <= set(obj) else obj
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentError(
                self, f"expected NAME=PATH (an adapter's name and its directory), got {item!r}"
            )
        return {name: path}


def _models_from_repeats(own: dict[str, Any], model_tag: str | None) -> list[dict[str, Any]] | None:
    """The `models` list that repeated --model / --served-model-name spell (taken out of own),
    or None when each was given at most once."""
    models = own.get("model")
    names = own.get("served_model_name")
    models = [] if models is None else models if isinstance(models, list) else [models]
    names = [] if names is None else names if isinstance(names, list) else [names]
    if len(models) <= 1 and len(names) <= 1:
        return None
    if model_tag is not None:
        raise ServeFlagsError("MODEL and repeated --model: give every model as --model")
    if len(names) > len(models):
        raise ServeFlagsError(
            f"--served-model-name is given {len(names)} times for {len(models)} models: "
            "pair each --served-model-name with a --model (by position)"
        )
    own.pop("model", None)
    own.pop("served_model_name", None)
    return [{"model": m, **({"served_model_name": names[i]} if i < len(names) else {})} for i, m in enumerate(models)]


def _choices(annotation) -> tuple[str, ...] | None:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(args)
    return None


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> ServeConfig:
    """ServeConfig from (lowest first) --config FILE, env SPLITSERVE_API_KEY, then the flags.
    Raises ServeFlagsError naming the problem."""
    environ = os.environ if environ is None else environ
    raw = _load_yaml(args.config) if getattr(args, "config", None) else {}
    if environ.get(API_KEY_ENV):
        raw["api_key"] = environ[API_KEY_ENV]
    given = _given_values(args)
    for path, value in given.items():
        _set(raw, path, value)
    try:
        return ServeConfig.model_validate(raw)
    except ValueError as exc:
        raise ServeFlagsError(_validation_message(exc)) from None


def _given_values(args: argparse.Namespace) -> dict[str, Any]:
    """{ServeConfig path: value} of everything given on the command line."""
    values = vars(args)
    source: CliSettingsSource = values["serve_flags"]
    own = {k: v for k, v in values.items() if k.split(".")[0] in ServeConfig.model_fields}
    models = _models_from_repeats(own, values.get("model_tag"))
    given = _flatten(source(parsed_args=own)())  # only what was given: the defaults are left unset
    if models is not None:
        if "models" in given:
            raise ServeFlagsError("give the models either as repeated --model flags or as --models, not both")
        given["models"] = models
    claimed: dict[str, str] = {path: flag_for(path) for path in given}

    def put(path: str, value: Any, flag: str) -> None:
        if path in given and given[path] != value and claimed[path] != flag:
            raise ServeFlagsError(f"{flag} and {claimed[path]} disagree: {value!r} vs {given[path]!r}")
        given[path], claimed[path] = value, flag

    fields = leaf_fields()
    for key, text in values.items():
        if not key.startswith(_SHORT_DEST):
            continue
        flag = key[len(_SHORT_DEST) :]
        short = SHORT_FORMS[flag]
        for path in short.paths:
            put(path, _parse_json_if_mapping(fields[path].annotation, text, flag), flag)
        for path, value in short.implies.items():
            put(path, value, flag)
    if values.get("model_tag") is not None and models is None:
        put("model", values["model_tag"], "MODEL")
    return given


def _parse_json_if_mapping(annotation, text: str, flag: str) -> Any:
    if typing.get_origin(annotation) is dict:
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ServeFlagsError(f"{flag} must be a JSON object, e.g. '{{\"decode_gpu\": 1}}': {exc}") from None
    return text


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    leaves = leaf_fields()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in leaves:
            flat.update(_flatten(value, f"{path}."))
        else:
            flat[path] = value
    return flat


def _set(tree: dict, path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        child = tree.get(key)
        if not isinstance(child, dict):
            child = tree[key] = {}
        tree = child
    tree[leaf] = value


def _load_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as exc:
        raise ServeFlagsError(f"cannot read --config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ServeFlagsError(f"--config {path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ServeFlagsError(f"--config {path} must hold a mapping of ServeConfig fields")
    return raw


def _validation_message(exc: ValueError) -> str:
    """One line per problem, named by its flag: "--prefill.replicas: Input should be ..."."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    leaves = leaf_fields()
    lines = []
    for err in errors():
        path = ".".join(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if path in leaves and "input" in err else ""
        lines.append(f"{flag_for(path) if path else 'config'}: {message}{got}")
    return "; ".join(lines)
