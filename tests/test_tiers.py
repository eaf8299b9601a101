"""Every collected test carries exactly one tier marker (tests/conftest.py), and the tier
follows what the test starts: `make test-fast` (the unit tier) must never start Ray or
`splitserve serve`."""

from __future__ import annotations

from tests.conftest import TIERS

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
