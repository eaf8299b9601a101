"""Every third-party module the server's packages import at run time comes with `pip install
splitserve`: its distribution is in pyproject.toml's [project] dependencies, or it is optional
and the code copes without it (SERVER_OPTIONAL). bench/, optional itself, may also use its
extras. Imports are read from the source (tests/helpers/layout.py), so one inside a function
counts, and mapped to distributions through this environment's installed metadata.
tests/cluster/test_serve_fresh_install.py checks the same by running a fresh install."""

from __future__ import annotations

import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from tests.helpers.layout import SourceTree, area_of

REPO = Path(__file__).resolve().parents[1]
TREE = SourceTree(REPO)
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# module -> the extra that installs it; the server runs without it.
SERVER_OPTIONAL = {"triton": "triton"}  # engine/ops falls back to torch ops when it cannot import
BENCH_EXTRAS = ("bench", "grammar-bench", "train")
# The system bench/vllm_throughput_worker.py compares against, run by vLLM's own interpreter.
NOT_OURS = {"vllm"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements: list[str]) -> set[str]:
    return {canonical(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in requirements}


DEPENDENCIES = requirement_names(PROJECT["dependencies"])
EXTRAS = {extra: requirement_names(reqs) for extra, reqs in PROJECT["optional-dependencies"].items()}
_PROVIDERS = importlib.metadata.packages_distributions()


def distributions_of(module: str) -> set[str]:
    """The installed distributions that provide `module` (a dotted name): for a namespace
    package shared by several (google.*), those with files under its first two parts; a module
    not installed here counts as the distribution of its own name."""
    top = module.split(".")[0]
    names = _PROVIDERS.get(top, [])
    if len(names) > 1 and "." in module:
        prefix = "/".join(module.split(".")[:2])
        names = [
            n for n in names if any(str(f).startswith(prefix) for f in importlib.metadata.distribution(n).files or ())
        ] or names
    return {canonical(n) for n in names} or {canonical(top)}


def third_party_imports(bench: bool) -> dict[str, set[str]]:
    """Imported module -> the files that import it, over bench/ or over the server's packages."""
    found: dict[str, set[str]] = {}
    for path in TREE.files:
        if (area_of(TREE.module_name(path)) == "bench") != bench:
            continue
        for module in TREE.imports(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top in ("splitserve", "__future__", ""):
                continue
            found.setdefault(module, set()).add(str(path.relative_to(REPO)))
    return found


def undeclared(imports: dict[str, set[str]], allowed: set[str], optional: set[str]) -> dict[str, list[str]]:
    """Distribution -> the files that import it, for each imported module none of whose
    distributions is allowed (top-level modules in `optional` aside)."""
    missing: dict[str, set[str]] = {}
    for module, files in imports.items():
        provided_by = distributions_of(module)
        if module.split(".")[0] not in optional and not provided_by & allowed:
            missing.setdefault(" or ".join(sorted(provided_by)), set()).update(files)
    return {dist: sorted(files) for dist, files in sorted(missing.items())}


def test_the_servers_imports_are_dependencies():
    imports = third_party_imports(bench=False)
    assert "compressed_tensors.compressors.pack_quantized.helpers" in imports  # a lazy import counts
    assert SERVER_OPTIONAL.keys() <= {m.split(".")[0] for m in imports}
    assert all(extra in EXTRAS for extra in SERVER_OPTIONAL.values())
    assert undeclared(imports, DEPENDENCIES, set(SERVER_OPTIONAL)) == {}


def test_the_benchmarks_imports_are_dependencies_or_bench_extras():
    allowed = DEPENDENCIES.union(*(EXTRAS[extra] for extra in BENCH_EXTRAS))
    assert undeclared(third_party_imports(bench=True), allowed, NOT_OURS | set(SERVER_OPTIONAL)) == {}


def test_a_module_only_an_extra_installs_is_caught():
    planted = {"openai": {"engine/x.py"}, "google.protobuf.message": {"cluster/y.py"}}
    assert undeclared(planted, DEPENDENCIES, set()) == {"openai": ["engine/x.py"]}
    assert undeclared(planted, DEPENDENCIES - {"protobuf"}, {"openai"}) == {"protobuf": ["cluster/y.py"]}
