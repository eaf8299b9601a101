"""Tenant configuration: field validation (a negative limit is an error naming the field), the
tenants file's errors naming the line, api_keys_file, one key for two tenants, keys never in a
repr or an error message, and the gate's reload keeping the old tenants on a bad file."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from splitserve.cluster.config import ServeConfig
from splitserve.cluster.state.database import open_state_engine
from splitserve.cluster.tenants.tenant_directory import TenantDirectory
from splitserve.cluster.tenants.tenant_gate import TenantGate
from splitserve.cluster.tenants.tenant_metrics import TenantMetrics
from splitserve.cluster.tenants.tenant_refusal import TenantRefusal
from splitserve.cluster.tenants.tenants_file import TenantsFileError, load_tenants_file, parse_tenants_yaml

SECRET = "sk-very-secret-value"


@pytest.mark.parametrize(
    "field", ["requests_per_minute", "tokens_per_minute", "max_requests_in_flight", "budget_tokens"]
)
def test_negative_limit_is_a_validation_error_naming_the_field(field):
    with pytest.raises(ValidationError) as exc:
        ServeConfig(tenants=[{"name": "a", "api_keys": [SECRET], field: -1}])
    assert f"tenants.0.{field}" in str(exc.value) and SECRET not in str(exc.value)


def test_tenant_needs_keys_and_unique_names():
    with pytest.raises(ValidationError, match="needs api_keys or api_keys_file"):
        ServeConfig(tenants=[{"name": "a"}])
    with pytest.raises(ValidationError, match="unique"):
        ServeConfig(tenants=[{"name": "a", "api_keys": ["x"]}, {"name": "a", "api_keys": ["y"]}])
    with pytest.raises(ValidationError):
        ServeConfig(tenants=[{"name": "a", "api_keys": ["x"], "budget_period": "week"}])


def test_file_errors_name_the_line_and_hide_keys(tmp_path):
    bad = tmp_path / "tenants.yaml"
    bad.write_text(f"tenants:\n  - name: a\n    api_keys: [{SECRET}]\n    tokens_per_minute: -5\n")
    with pytest.raises(TenantsFileError) as exc:
        load_tenants_file(bad)
    message = str(exc.value)
    assert f"{bad}: line 4: tenants[0].tokens_per_minute" in message and SECRET not in message
    with pytest.raises(TenantsFileError, match="line 3"):
        parse_tenants_yaml("- name: a\n  api_keys: [x\n  - y: [")
    with pytest.raises(TenantsFileError, match=r"line 3: tenants\[1\].bogus"):
        parse_tenants_yaml("- {name: a, api_keys: [x]}\n- name: b\n  bogus: 1\n  api_keys: [y]\n")
    assert [t.name for t in parse_tenants_yaml("- {name: a, api_keys: [x]}")] == ["a"]
    assert repr(parse_tenants_yaml(f"- {{name: a, api_keys: [{SECRET}]}}")[0]) == "TenantConfig(name='a')"


def test_directory_reads_keys_files_and_refuses_a_shared_key(tmp_path):
    keys = tmp_path / "team-a"
    keys.write_text("# one key a line\nsk-a1\n\nsk-a2\n")
    directory = TenantDirectory.load(
        ServeConfig(tenants=[{"name": "a", "api_keys_file": str(keys)}, {"name": "b", "api_keys": ["sk-b"]}]).tenants,
        None,
    )
    assert directory.lookup("sk-a2").name == "a" and directory.lookup("sk-b").name == "b"
    assert directory.lookup("sk-a3") is None and directory.lookup(None) is None
    with pytest.raises(TenantsFileError, match="both tenants 'a' and 'b'"):
        TenantDirectory.load(
            ServeConfig(tenants=[{"name": "a", "api_keys": ["k"]}, {"name": "b", "api_keys": ["k"]}]).tenants, None
        )
    with_operator = TenantDirectory.load(
        ServeConfig(tenants=[{"name": "b", "api_keys": ["sk-b"]}]).tenants, None, "sk-op"
    )
    assert with_operator.lookup("sk-op").name == "operator" and with_operator.lookup("sk-op").budget_tokens is None
    with pytest.raises(TenantsFileError, match="cannot read api_keys_file"):
        TenantDirectory.load(ServeConfig(tenants=[{"name": "a", "api_keys_file": str(tmp_path / "no")}]).tenants, None)


def test_gate_reload_revokes_and_a_bad_file_keeps_the_old_tenants(tmp_path, caplog):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"- {{name: a, api_keys: [{SECRET}]}}\n")
    cfg = ServeConfig(tenants_file=str(path), state_dir=str(tmp_path / "state"))
    engine = open_state_engine(f"sqlite:///{tmp_path / 'state.db'}")
    gate = TenantGate(cfg, engine, "ingress-a", TenantMetrics(CollectorRegistry()))
    assert gate.authenticate(SECRET).name == "a"
    path.write_text("- name: a\n  api_keys: [x]\n  requests_per_minute: -1\n")
    with caplog.at_level(logging.ERROR):
        asyncio.run(gate.tick())
    assert "line 3" in caplog.text and SECRET not in caplog.text
    assert gate.authenticate(SECRET).name == "a"  # the old tenants stay
    path.write_text("- {name: a, api_keys: [sk-new]}\n  # a changed size: the stamp differs\n")
    asyncio.run(gate.tick())
    with pytest.raises(TenantRefusal) as refused:
        gate.authenticate(SECRET)
    assert refused.value.status == 401
    engine.dispose()


def test_bad_tenants_file_at_startup_is_an_error(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text("- name: a\n  api_keys: [x]\n  models: 5\n")
    engine = open_state_engine(f"sqlite:///{tmp_path / 'state.db'}")
    with pytest.raises(TenantsFileError, match="line 3"):
        TenantGate(ServeConfig(tenants_file=str(path)), engine, "i", TenantMetrics(CollectorRegistry()))
    engine.dispose()


def test_serve_refuses_a_malformed_tenants_file_in_one_line_before_starting(tmp_path, capsys, monkeypatch):
    from splitserve.cluster.cli.main import main

    # serve sets Ray's env vars before its checks: keep them out of this process.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    path = tmp_path / "tenants.yaml"
    path.write_text(f"- name: a\n  api_keys: [{SECRET}]\n  requests_per_minute: -1\n")
    assert main(["serve", "--tenants-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"tenants: {path}: line 3: tenants[0].requests_per_minute" in err and SECRET not in err
