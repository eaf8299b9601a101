"""The layout holds: imports flow one way, the torch-free parts stay torch-free, and
docs/ARCHITECTURE.md names every module. Read from the source (ast), not from what happens to
be imported at test time, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kvtransfer", "prefill", "decode", "cluster", "proto", "bench")
# What each top-level package may import from splitserve (besides itself):
# cluster -> prefill/decode -> kvtransfer -> engine; proto is the API description; bench sits on top.
ALLOWED = {
    "engine": set(),
    "proto": set(),
    "kvtransfer": {"engine"},
    "prefill": {"kvtransfer", "engine"},
    "decode": {"kvtransfer", "engine"},
    "cluster": {"prefill", "decode", "kvtransfer", "engine", "proto"},
    "bench": {"cluster", "prefill", "decode", "kvtransfer", "engine", "proto"},
}
TORCH_FREE = ("engine/core", "cluster/routing", "engine/simulated")
HEAVY = ("torch", "triton")


def _source_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        files += [p for p in (REPO / package).rglob("*.py") if "_pb2" not in p.name]
    return sorted(files)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return "splitserve." + ".".join(parts)


def _in_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _parse_imports(source: str, package: str) -> tuple[str, ...]:
    """Every module the source imports, at any depth (TYPE_CHECKING blocks excepted), absolute;
    package: the package relative imports start from."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if _in_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append(module)
            # `from splitserve.x import y` may import the submodule splitserve.x.y
            found += [f"{module}.{alias.name}" for alias in node.names]
    return tuple(found)


@cache
def _imports(path: Path) -> tuple[str, ...]:
    name = _module_name(path)
    return _parse_imports(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def _top_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "splitserve" and parts[1] in PACKAGES else None


MODULES = {_module_name(p): p for p in _source_files()}


@pytest.mark.parametrize("path", _source_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_imports_flow_one_way(path):
    own = path.relative_to(REPO).parts[0]
    bad = sorted({m for m in _imports(path) if (top := _top_package(m)) and top != own and top not in ALLOWED[own]})
    assert not bad, f"{own}/ may import only {sorted(ALLOWED[own]) or 'nothing else'}; it imports {bad}"


def _reachable(start: str) -> dict[str, str]:
    """splitserve modules reachable from start by imports -> the module that imported each."""
    seen = {start: start}
    todo = [start]
    while todo:
        module = todo.pop()
        for imported in _imports(MODULES[module]):
            if imported in MODULES and imported not in seen:
                seen[imported] = module
                todo.append(imported)
    return seen


@pytest.mark.parametrize("area", TORCH_FREE)
def test_torch_free_areas_reach_no_torch(area):
    starts = [m for m, p in MODULES.items() if p.is_relative_to(REPO / area)]
    assert starts, f"no modules under {area}"
    for start in starts:
        for module, importer in _reachable(start).items():
            heavy = [m for m in _imports(MODULES[module]) if m.split(".")[0] in HEAVY]
            assert not heavy, f"{start} reaches {module} (imported by {importer}), which imports {heavy}"


def test_prefill_and_decode_do_not_import_each_other():
    for own, other in (("prefill", "decode"), ("decode", "prefill")):
        for path in (REPO / own).rglob("*.py"):
            assert not [m for m in _imports(path) if _top_package(m) == other], path


def test_the_checker_catches_a_violation():
    """The rules can fail: planted upward, relative and torch imports are all seen."""
    source = (REPO / "engine" / "core" / "block_pool.py").read_text()
    planted = source + "\ndef f():\n    import torch\n    from ...cluster.config import ServeConfig\n"
    imports = _parse_imports(planted, "splitserve.engine.core")
    assert "torch" in imports and "splitserve.cluster.config" in imports
    assert _top_package("splitserve.cluster.config") not in ALLOWED["engine"]
    assert "torch" not in _parse_imports("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", "x")


def test_architecture_names_every_module():
    """docs/ARCHITECTURE.md's module map names each module, in backticks, by its path below its
    top-level package (`core/block_pool.py` under engine/), by its repo path, or by its file name
    where that name is unique in the tree."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    files = [p for p in _source_files() if p.name not in ("__init__.py", "__main__.py")]
    name_counts: dict[str, int] = {}
    for path in files:
        name_counts[path.name] = name_counts.get(path.name, 0) + 1
    missing = []
    for path in files:
        rel = path.relative_to(REPO)
        names = {rel.as_posix(), Path(*rel.parts[1:]).as_posix()}
        if name_counts[path.name] == 1:
            names.add(path.name)
        if not any(f"`{name}`" in text for name in names):
            missing.append(rel.as_posix())
    assert not missing, f"docs/ARCHITECTURE.md does not name: {missing}"


def test_a_simulated_replica_never_imports_torch(tiny_model):
    """A fresh interpreter imports both workers, builds a simulated engine (tokenizer and
    config of a real checkpoint) with its KV link, and runs a request: no torch anywhere."""
    code = f"""
import sys
from splitserve.decode.decode_worker import DecodeWorker
from splitserve.prefill.prefill_worker import PrefillWorker
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_factory import build_engine
from splitserve.engine.io.sampling_params import SamplingParams
from splitserve.kvtransfer.kv_link import make_sender, open_transport, post_receive
engine = build_engine(EngineConfig(model={tiny_model!r}, engine="simulated", profile="llama-8b-h200"))
transport = open_transport("p", engine, "127.0.0.1", 5.0)
make_sender(transport, engine.kv_cache).close()
post_receive(transport, engine.kv_cache, "d", 1, [0, 1], True).complete(1.0)
assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids) == 3
print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
