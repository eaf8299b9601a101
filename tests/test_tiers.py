"""Every collected test carries exactly one tier marker (tests/conftest.py), and the tier
follows what the test starts: `make test-fast` (the unit tier) must never start Ray or
`splitserve serve`. Under pytest-xdist, what starts `splitserve serve`, HAProxy or Postgres is in
the xdist group `serial`, the rest of the cluster tier in the group `ray`: each group runs on one
worker, test after test."""

from __future__ import annotations

import inspect
import re

from tests.conftest import RAY_GROUP, SERIAL_GROUP, TIERS, file_group

# Files whose tests all start the same thing; checked when they are collected with this one.
EXPECTED = {
    "tests/cluster/test_serve_e2e.py": "e2e",  # a ServeProcess from a module fixture
    "tests/cluster/test_soak.py": "e2e",  # marked: soak() starts it inside the test
    "tests/workers/test_disagg.py": "cluster",  # the ray_cluster fixture, through its own
    "tests/workers/test_faults.py": "cluster",  # ... and through a ServingBackend fixture
    "tests/test_layout.py": "unit",
}


def tiers_of(item) -> list[str]:
    return [tier for tier in TIERS if item.get_closest_marker(tier) is not None]


def test_every_collected_test_has_exactly_one_tier(request):
    wrong = {item.nodeid: tiers_of(item) for item in request.session.items if len(tiers_of(item)) != 1}
    assert wrong == {}


def test_a_test_on_ray_or_serve_is_never_unit(request):
    for item in request.session.items:
        if "ray_cluster" in item.fixturenames:
            assert tiers_of(item) in (["cluster"], ["e2e"]), item.nodeid
        path = item.nodeid.split("::", 1)[0]
        if path in EXPECTED:
            assert tiers_of(item) == [EXPECTED[path]], item.nodeid
    assert tiers_of(request.node) == ["unit"]


def xdist_groups_of(item) -> list[str]:
    return [mark.args[0] if mark.args else mark.kwargs["name"] for mark in item.iter_markers("xdist_group")]


def expected_xdist_group(item) -> str | None:
    callspec = getattr(item, "callspec", None)
    on_postgres = callspec is not None and callspec.params.get("state_url") == "postgres"
    serial = tiers_of(item) == ["e2e"] or on_postgres or "postgres_url" in item.fixturenames
    serial = serial or item.get_closest_marker("serial") is not None
    if serial:
        return SERIAL_GROUP
    if tiers_of(item) == ["cluster"]:
        return RAY_GROUP
    return file_group(item) if item.get_closest_marker("one_worker") is not None else None


def test_e2e_postgres_and_serial_tests_share_one_xdist_group_and_the_cluster_tier_another(request):
    # On an xdist worker under --dist loadgroup, xdist's scheduler reads the group from a suffix
    # it appends to the node id: without it (pytest-dev/pytest-xdist#1386) the group is ignored.
    grouped_by_id = getattr(request.config.option, "loadgroup", False)
    for item in request.session.items:
        group = expected_xdist_group(item)
        assert xdist_groups_of(item) == ([group] if group else []), item.nodeid
        if grouped_by_id:
            suffixes = [name for name in (SERIAL_GROUP, RAY_GROUP) if item.nodeid.endswith(f"@{name}")]
            if group not in (None, SERIAL_GROUP, RAY_GROUP):  # a one_worker file's own group
                suffixes += [group] if item.nodeid.endswith(f"@{group}") else []
            assert suffixes == ([group] if group else []), item.nodeid
    assert xdist_groups_of(request.node) == []


# What starts Ray Serve (its HAProxy binds fixed ports), in a test module's source.
STARTS_SERVE = re.compile(r"\bServeProcess\b|\bshutdown_serve\b|from ray import serve|\bray\.serve\b")


def test_nothing_in_the_ray_group_starts_serve(request):
    """The ray group's worker runs beside the serial one: a test there that starts `splitserve
    serve` or Ray Serve (through a helper the tier rule does not see) must be marked e2e."""
    modules = {item.module for item in request.session.items if RAY_GROUP in xdist_groups_of(item)}
    assert [m.__name__ for m in modules if STARTS_SERVE.search(inspect.getsource(m))] == []
