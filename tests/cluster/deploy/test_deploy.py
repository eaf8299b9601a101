"""Deployment with the Ray cluster launcher: the `ray up` configs in cluster/deploy/.

Everything runs offline: Ray's own cluster-config preparation and schema, no cloud calls.
The Helm chart is tested in tests/cluster/deploy/test_deploy_helm.py.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import subprocess
import tomllib
from typing import Any

import pytest

from splitserve.cluster.config import ServeConfig  # noqa: E402
from tests.helpers import deploy  # noqa: E402

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

RAY_UP_CONFIGS = ["aws-gpu.yaml", "local.yaml"]
SERVE_CONFIG_PATH = deploy.DEPLOY_DIR / "serve-gpu.yaml"
POOLS = deploy.POOLS


def _serve_config() -> ServeConfig:
    return ServeConfig.model_validate(deploy.load_yaml(SERVE_CONFIG_PATH))


def _prepared_ray_config(name: str) -> dict[str, Any]:
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(deploy.load_yaml(deploy.DEPLOY_DIR / name))


def _custom_resources(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if k not in ("CPU", "GPU", "memory")}


@pytest.mark.parametrize("name", RAY_UP_CONFIGS)
def test_ray_up_config_passes_rays_schema(name):
    from ray.autoscaler._private.util import validate_config

    validate_config(_prepared_ray_config(name))


def test_serve_gpu_yaml_is_a_gpu_serve_config():
    cfg = _serve_config()
    assert cfg.device == "cuda" and cfg.http_host == "0.0.0.0" and cfg.grpc_host == "0.0.0.0"
    for pool in POOLS:
        pool_cfg = getattr(cfg, pool)
        assert pool_cfg.resources.num_gpus == 1
        assert pool_cfg.resources.resources == {f"{pool}_gpu": 1}
        assert pool_cfg.autoscaling.enabled
        assert pool_cfg.autoscaling.min_replicas < pool_cfg.autoscaling.max_replicas


def test_two_models_land_on_their_own_gpu_node_types():
    """serve-gpu-two-models.yaml on aws-gpu.yaml: every pool of each model asks for a custom
    resource exactly one node type advertises, that node type fits a replica and can hold the
    pool's ceiling, no node type hosts two models, and every node downloads both models."""
    raw = deploy.load_yaml(deploy.DEPLOY_DIR / "serve-gpu-two-models.yaml")
    deployments = ServeConfig.model_validate(raw).model_deployments()
    assert [name for name, _ in deployments] == ["small", "large"]
    config = _prepared_ray_config("aws-gpu.yaml")
    node_types = config["available_node_types"]
    owner: dict[str, str] = {}
    for name, cfg in deployments:
        assert cfg.device == "cuda" and not cfg.models
        for pool in POOLS:
            pool_cfg = getattr(cfg, pool)
            if not (pool_cfg.replicas or pool_cfg.autoscaling.enabled):
                continue  # this model has no such pool (decode prefills locally)
            hosts = [t for t, spec in node_types.items() if set(pool_cfg.resources.resources) & set(spec["resources"])]
            assert len(hosts) == 1, (name, pool, hosts)
            spec = node_types[hosts[0]]
            assert _replicas_per_node(spec["resources"], pool_cfg) >= 1
            assert (
                spec["max_workers"] * _replicas_per_node(spec["resources"], pool_cfg)
                >= pool_cfg.autoscaling.max_replicas
            )
            assert owner.setdefault(hosts[0], name) == name, f"{hosts[0]} hosts two models"
        for commands in (config["head_setup_commands"], config["worker_setup_commands"]):
            assert f"local_dir='{cfg.model}'" in "\n".join(commands)
    assert len(set(owner.values())) == 2


def _replicas_per_node(node_resources: dict[str, float], pool_cfg) -> int:
    """Whole replicas a node holds: a replica is tensor_parallel_size ranks on one node, each
    asking for the pool's resources (cluster/control/replica_gang.py's bundles)."""
    request = {"CPU": pool_cfg.resources.num_cpus, "GPU": pool_cfg.resources.num_gpus, **pool_cfg.resources.resources}
    size = pool_cfg.tensor_parallel_size
    return min(int(node_resources.get(k, 0) // (v * size)) for k, v in request.items() if v > 0)


def test_tensor_parallel_pools_fit_their_node_types():
    """serve-gpu-tp.yaml on aws-gpu.yaml: each pool's custom resource is advertised by one node
    type only, which holds at least one whole replica (TP x the pool's GPUs on one node) and,
    at max_workers, the pool's ceiling; a 1-GPU node type could hold none of them."""
    cfg = ServeConfig.model_validate(deploy.load_yaml(deploy.DEPLOY_DIR / "serve-gpu-tp.yaml"))
    node_types = _prepared_ray_config("aws-gpu.yaml")["available_node_types"]
    sizes = {pool: getattr(cfg, pool).tensor_parallel_size for pool in POOLS}
    assert sizes == {"prefill": 4, "decode": 2}
    for pool in POOLS:
        pool_cfg = getattr(cfg, pool)
        hosts = [t for t, spec in node_types.items() if set(pool_cfg.resources.resources) & set(spec["resources"])]
        assert len(hosts) == 1, (pool, hosts)
        spec = node_types[hosts[0]]
        per_node = _replicas_per_node(spec["resources"], pool_cfg)
        assert per_node >= 1
        assert spec["resources"]["GPU"] >= pool_cfg.tensor_parallel_size * pool_cfg.resources.num_gpus
        assert spec["max_workers"] * per_node >= pool_cfg.autoscaling.max_replicas
        one_gpu = node_types[f"{pool}_gpu_worker"]["resources"] | dict.fromkeys(pool_cfg.resources.resources, 1)
        assert _replicas_per_node(one_gpu, pool_cfg) == 0
    assert f"local_dir='{cfg.model}'" in "\n".join(_prepared_ray_config("aws-gpu.yaml")["worker_setup_commands"])


def test_aws_worker_node_types_host_their_pool():
    config = _prepared_ray_config("aws-gpu.yaml")
    cfg = _serve_config()
    node_types = config["available_node_types"]
    head = node_types[config["head_node_type"]]
    assert head["resources"].get("GPU") == 0 and not _custom_resources(head["resources"])
    assert config["max_workers"] >= sum(t.get("max_workers", 0) for t in node_types.values())
    for pool in POOLS:
        pool_cfg = getattr(cfg, pool)
        node_type = node_types[f"{pool}_gpu_worker"]
        # Exactly the pool's custom resources, and no other node type advertises them.
        assert set(_custom_resources(node_type["resources"])) == set(pool_cfg.resources.resources)
        for other_name, other in node_types.items():
            if other is not node_type:
                assert not set(other["resources"]) & set(pool_cfg.resources.resources), other_name
        per_node = _replicas_per_node(node_type["resources"], pool_cfg)
        assert per_node >= 1
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"]
        # The autoscaler can grow the pool to its ceiling and holds its floor.
        assert node_type["max_workers"] * per_node >= pool_cfg.autoscaling.max_replicas
        assert node_type["min_workers"] * per_node >= pool_cfg.autoscaling.min_replicas


def _run_local_worker_start(command: str, ip: str, num_gpus: int) -> subprocess.CompletedProcess:
    """Run local.yaml's worker start command with hostname/nvidia-smi/ray stubbed out."""
    stubs = (
        f"hostname() {{ echo '{ip} 172.17.0.1'; }}; "
        f"nvidia-smi() {{ for i in $(seq 1 {num_gpus}); do echo GPU; done; }}; "
        "ray() { printf '%s\\n' \"$@\"; }; ulimit() { :; }; "
    )
    env = {"PATH": os.environ["PATH"], "RAY_HEAD_IP": "10.0.0.10"}
    return subprocess.run(["bash", "-c", stubs + command], capture_output=True, text=True, env=env, timeout=10)


def test_local_workers_advertise_their_pools_resources():
    raw = deploy.load_yaml(deploy.DEPLOY_DIR / "local.yaml")
    cfg = _serve_config()
    start = raw["worker_start_ray_commands"][-1]
    advertised: dict[str, set[str]] = {}
    for ip in raw["provider"]["worker_ips"]:
        result = _run_local_worker_start(start, ip, num_gpus=2)
        assert result.returncode == 0, result.stderr
        args = result.stdout.split("\n")
        assert args[0] == "start" and "--address=10.0.0.10:6379" in args
        assert "--num-gpus=2" in args
        resources = json.loads(next(a for a in args if a.startswith("--resources=")).removeprefix("--resources="))
        assert len(resources) == 1
        ((pool_resource, amount),) = resources.items()
        assert amount == 2  # one unit per GPU
        advertised.setdefault(pool_resource, set()).add(ip)
    # Both pools get machines; a pool replica (1 GPU + 1 unit) fits each of them.
    for pool in POOLS:
        pool_cfg = getattr(cfg, pool)
        ((name, per_replica),) = pool_cfg.resources.resources.items()
        assert name in advertised, f"no local worker advertises {name}"
        assert per_replica == pool_cfg.resources.num_gpus
    assert set(advertised) == {k for pool in POOLS for k in getattr(cfg, pool).resources.resources}
    unknown = _run_local_worker_start(start, "10.9.9.9", num_gpus=1)
    assert unknown.returncode != 0 and "no pool" in unknown.stderr
    head_start = " ".join(raw["head_start_ray_commands"])
    assert "--head" in head_start and "--num-gpus=0" in head_start


@pytest.mark.parametrize("name", RAY_UP_CONFIGS)
def test_ray_up_ships_serve_config_and_model(name):
    raw = deploy.load_yaml(deploy.DEPLOY_DIR / name)
    config = _prepared_ray_config(name)
    cfg = _serve_config()
    serve_cmd = next(c for c in config["head_start_ray_commands"] if "splitserve serve" in c)
    argv = shlex.split(serve_cmd.split(">")[0].removeprefix("nohup "))
    assert argv[:2] == ["splitserve", "serve"]
    assert argv[argv.index("--address") + 1] == "auto"
    remote_config = argv[argv.index("--config") + 1]
    # The --config path is inside a file mount whose local side is this repo's serve-gpu.yaml.
    local = None
    for remote_dir, local_dir in raw["file_mounts"].items():
        if remote_config.startswith(remote_dir.rstrip("/") + "/"):
            local = deploy.REPO_ROOT / local_dir / remote_config[len(remote_dir) + 1 :]
    assert local is not None and local.resolve() == SERVE_CONFIG_PATH.resolve()
    # Every node installs the wheel from a mounted dist/ and downloads the weights to the
    # path the serve config loads them from.
    assert any(local_dir.rstrip("/").endswith("dist") for local_dir in raw["file_mounts"].values())
    for commands in (config["head_setup_commands"], config["worker_setup_commands"]):
        text = "\n".join(commands)
        assert "splitserve/dist/splitserve-" in text
        assert f"local_dir='{cfg.model}'" in text


@pytest.mark.parametrize("name", RAY_UP_CONFIGS)
def test_ray_up_serve_command_is_accepted_by_the_cli(name):
    from splitserve.cluster.cli import main as cli
    from splitserve.cluster.cli.serve_flags import config_from_args

    raw = deploy.load_yaml(deploy.DEPLOY_DIR / name)
    serve_cmd = next(c for c in raw["head_start_ray_commands"] if "splitserve serve" in c)
    argv = shlex.split(serve_cmd.split(">")[0].removeprefix("nohup "))
    argv[argv.index("--config") + 1] = str(SERVE_CONFIG_PATH)  # the file ray up mounts there
    args = cli.build_parser().parse_args(argv[1:])
    assert args.address == "auto"
    assert config_from_args(args, environ={}) == _serve_config()


def test_deploy_files_ship_with_the_package():
    pyproject = tomllib.loads((deploy.REPO_ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["splitserve.cluster"]
    for path in deploy.DEPLOY_DIR.iterdir():
        rel = path.relative_to(deploy.REPO_ROOT / "cluster").as_posix()
        if path.is_file():
            assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not package data"


def test_versions_agree():
    """Ray in the venv, the chart, the image and pyproject agree; the chart is the package's."""
    import ray

    values = deploy.load_yaml(deploy.CHART_DIR / "values.yaml")
    chart = deploy.load_yaml(deploy.CHART_DIR / "Chart.yaml")
    pyproject = tomllib.loads((deploy.REPO_ROOT / "pyproject.toml").read_text())
    assert values["rayVersion"] == ray.__version__
    assert chart["appVersion"] == pyproject["project"]["version"]
    dockerfile = (deploy.DEPLOY_DIR / "Dockerfile").read_text()
    assert f"rayproject/ray:{ray.__version__}-" in dockerfile
    assert f"ray[serve]=={ray.__version__}" in pyproject["project"]["dependencies"]
