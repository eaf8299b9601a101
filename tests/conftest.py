"""Shared fixtures: random checkpoints (made once per session) and a local Ray cluster."""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch's c10d reverse-resolves the peer of every store connection (a KV pair opening, a TP
# rendezvous): ::ffff:127.0.0.1, which /etc/hosts does not list, so each is a DNS PTR query. A
# resolver that drops some (this sandbox's drops one in ~25, machine-wide) costs glibc's default
# 5 s timeout each time, hundreds of seconds over the suite. Retrying after 1 s instead changes
# no result: the lookup only names the peer in torch's logs. Every process the tests start
# (Ray workers, `splitserve serve`) inherits it.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:3")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models on 2 shared cores: more threads only wait on each other.
torch.set_num_threads(1)

from tests.helpers.model import make_checkpoint  # noqa: E402
from tests.helpers.wheel import WheelBuilds  # noqa: E402


@pytest.fixture(scope="session")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_root) -> str:
    """tiny llama (GQA) checkpoint directory."""
    return str(make_checkpoint(models_root, "tiny", "llama"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread from a module's first test to its last, for the modules that
    ask (pytest.mark.usefixtures): tests/helpers/model.py's single_torch_thread, module-wide."""
    from tests.helpers.model import single_torch_thread

    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def loop():
    """An asyncio loop in a thread, for driving a DisaggCluster from synchronous tests."""
    from tests.helpers.cluster import LoopThread

    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance for the whole session, on 127.0.0.1: a new one of this process's
    own (address "local"), never one found on the machine, since under pytest-xdist two workers
    each hold one (the xdist groups below) and must not share named actors."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            logging_level="ERROR",
            log_to_driver=False,
        )
    yield ray
    ray.shutdown()


# ---- the ways into a module's serving cluster ---------------------------------------------------
# A module that serves a real cluster defines `backend` (a started ServingBackend: serving_backend
# in tests/helpers/cluster.py); these fixtures reach it as its tests do. A module overrides one
# where it needs another shape (a longer client timeout, a server that also runs batches).


@pytest.fixture(scope="module")
def cluster(backend):
    """The module's DisaggCluster, behind its backend."""
    return backend.cluster


@pytest.fixture(scope="module")
def server(loop, backend):
    """The HTTP app over the module's backend, served on the cluster's own loop."""
    from splitserve.cluster.frontend.http.api import build_http_app
    from tests.helpers.cluster import LoopHttpServer

    with LoopHttpServer(loop, build_http_app(backend)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """An OpenAI client of `server` that never retries."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    """An httpx client of `server`."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as module_http:
        yield module_http


@pytest.fixture(scope="module")
def grpc_port(loop, backend):
    """The port of a gRPC frontend over the module's backend."""
    from tests.helpers.cluster import grpc_frontend_port

    with grpc_frontend_port(loop, backend) as port:
        yield port


@pytest.fixture(scope="module")
def stub(loop, backend):
    """A gRPC SplitServeStub of a frontend over the module's backend."""
    from tests.helpers.cluster import grpc_stub

    with grpc_stub(loop, backend) as module_stub:
        yield module_stub


# ---- test tiers ------------------------------------------------------------------------------
# Every test gets exactly one tier marker, from what it starts (see README, Development):
#   e2e     - a `splitserve serve` subprocess (a fixture or the test builds a ServeProcess), or
#             marked e2e by hand (a test that runs the CLI until Ray Serve starts, or whose
#             helpers start `splitserve serve`: the tier rule sees only fixtures and the test);
#   cluster - the session's local Ray cluster (the ray_cluster fixture, however indirectly),
#             or marked `ray` (it starts Ray some other way);
#   unit    - everything else: in-process objects, sockets, short subprocesses.
TIERS = ("unit", "cluster", "e2e")


def _starts_serve_process(func) -> bool:
    code = getattr(func, "__code__", None)
    return code is not None and "ServeProcess" in code.co_names


def tier_of(item) -> str:
    explicit = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
    if len(explicit) > 1:
        raise pytest.UsageError(f"{item.nodeid} is marked with more than one tier: {explicit}")
    if explicit:
        return explicit[0]
    fixturedefs = getattr(item, "_fixtureinfo", None)
    funcs = [getattr(item, "function", None)]
    if fixturedefs is not None:
        funcs += [d.func for defs in fixturedefs.name2fixturedefs.values() for d in defs]
    if any(_starts_serve_process(f) for f in funcs):
        return "e2e"
    if "ray_cluster" in getattr(item, "fixturenames", ()) or item.get_closest_marker("ray") is not None:
        return "cluster"
    return "unit"


# ---- what runs apart under pytest-xdist ------------------------------------------------------
# `make test` runs with `-n 3 --dist loadgroup`: xdist hands each group whole to one worker, which
# runs its tests one at a time, while the other workers share the ungrouped (unit) tests and take
# some once their group is done. Two groups:
# - SERIAL_GROUP: what binds a fixed port or holds the one server of its kind: the e2e tier
#   (`splitserve serve`: Ray Serve's HAProxy binds the fixed ports 8404/9101, so two servers
#   collide), a test on the session's Postgres server (one server, on the worker that runs them
#   all) and a test marked `serial` (it starts HAProxy or binds a fixed port some other way);
# - RAY_GROUP: the rest of the cluster tier (actors, a DisaggCluster, a ServingBackend on the
#   session's Ray cluster; no Serve, no fixed port). Its worker holds a Ray instance of its own
#   (ray_cluster: address "local"), beside the one the serial worker starts for the e2e tests
#   that join the session's cluster (`--address`), so the two chains of Ray tests overlap.
# And a unit-tier file marked `one_worker` (its tests share a costly module fixture: the one
# subprocess that runs every interpreted Triton case, say) is a group of its own, its file's
# path, so that fixture is built once on one worker and never once on each. `one_worker(name)`
# joins the tests of several files in one group, `name`: those that read one costly shared
# thing, such as a trained checkpoint of the machine's model cache (tests/helpers/model.py's
# READS_TRAINED_CHECKPOINT),
# which the first reader trains (~100 s of one core where the cache lacks it) while any other
# reader waits on the cache's lock: on one worker, the other workers run other tests meanwhile.
SERIAL_GROUP = "serial"
RAY_GROUP = "ray"


def file_group(item) -> str:
    """The xdist group of a test marked `one_worker`: the marker's name, else the file's path."""
    mark = item.get_closest_marker("one_worker")
    if mark is not None and mark.args:
        return mark.args[0]
    return item.nodeid.split("::", 1)[0]


def runs_serially(item, tier: str) -> bool:
    if tier == "e2e" or item.get_closest_marker("serial") is not None:
        return True
    if "postgres_url" in getattr(item, "fixturenames", ()):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("state_url") == "postgres"


def xdist_group_of(item, tier: str) -> str | None:
    if runs_serially(item, tier):
        return SERIAL_GROUP
    if tier == "cluster":
        return RAY_GROUP
    return file_group(item) if item.get_closest_marker("one_worker") is not None else None


# tryfirst: xdist's own hook (registered after this file) reads the xdist_group markers.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
        group = xdist_group_of(item, tier)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


# ---- the checkout's wheel and a fresh venv with it, built once per session ------------------
# The fresh venv (tests/helpers/wheel.py) takes ~10 s; its users (test_serve_fresh_install)
# run late in the serial group, so the first serial test on a worker starts it in the background.
WHEEL_BUILDS = pytest.StashKey[WheelBuilds]()
FRESH_VENV_WANTED = pytest.StashKey[bool]()
FRESH_VENV_FIXTURE = "fresh_venv"


def _wheel_builds(config) -> WheelBuilds:
    if WHEEL_BUILDS not in config.stash:
        # tmp_path_factory's own object: the builds land under the session's basetemp.
        config.stash[WHEEL_BUILDS] = WheelBuilds(config._tmp_path_factory.mktemp)
    return config.stash[WHEEL_BUILDS]


def pytest_runtest_setup(item):
    group = item.get_closest_marker("xdist_group")
    if group is None or group.args != (SERIAL_GROUP,):
        return
    config = item.config
    if FRESH_VENV_WANTED not in config.stash:  # the items left after -m/-k deselection
        config.stash[FRESH_VENV_WANTED] = any(FRESH_VENV_FIXTURE in it.fixturenames for it in item.session.items)
    if config.stash[FRESH_VENV_WANTED]:
        _wheel_builds(config).start_fresh_venv()


@pytest.fixture(scope="session")
def wheel_builds(request):
    """The session's WheelBuilds: build_wheel's wheel of this checkout, the fresh venv with it."""
    return _wheel_builds(request.config)


@pytest.fixture(scope="session")
def fresh_venv(wheel_builds):
    """install_in_fresh_venv's venv with this checkout's wheel (built once, started early)."""
    return wheel_builds.fresh_venv()


_state_db_names = itertools.count()


@pytest.fixture(scope="session")
def postgres_url():
    """The URL of a throwaway Postgres server (tests/helpers/postgres.py) for the whole session."""
    from tests.helpers.postgres import PostgresServer, skip_or_fail_without_postgres

    server = PostgresServer(skip_or_fail_without_postgres()).start()
    yield server.url
    server.stop()


@pytest.fixture(params=["sqlite", "postgres"])
def state_url(request, tmp_path):
    """A fresh, empty state-store database per test: SQLite in tmp_path, then a new database on
    the session's Postgres server; parametrizes every test that uses it over both."""
    import sqlalchemy as sa

    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'state' / 'state.db'}"
        return
    server_url = request.getfixturevalue("postgres_url")
    name = f"state_{next(_state_db_names)}"
    admin = sa.create_engine(server_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    yield server_url.rsplit("/", 1)[0] + f"/{name}"
    with admin.connect() as conn:
        conn.execute(sa.text(f"DROP DATABASE {name} WITH (FORCE)"))
    admin.dispose()
