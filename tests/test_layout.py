"""The layout holds: imports flow one way, the torch-free parts stay torch-free, cluster's parts
import each other without cycles, shipped code imports no test code, every package folder has a
README.md that names each of its modules and no module that is not there, and docs/ARCHITECTURE.md
links every top-level folder's README and names nothing that is not there. The rules live in
tests/helpers/layout.py; each self-test below plants a violation in a temporary tree and checks
that it is caught."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.layout import ALLOWED, HEAVY, MESSAGES, TORCH_FREE, SourceTree, area_of, parse_imports

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "ARCHITECTURE.md"
TREE = SourceTree(REPO)


@pytest.mark.parametrize("path", TREE.files, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_flow_one_way(path):
    own = area_of(TREE.module_name(path))
    bad = TREE.flow_violations(path)
    assert not bad, f"{own} may import only {sorted(ALLOWED[own]) or 'nothing else'}; it imports {bad}"


@pytest.mark.parametrize("area", TORCH_FREE)
def test_torch_free_areas_reach_no_torch(area):
    heavy = TREE.heavy_reached(area)
    assert not heavy, heavy[0]


def test_prefill_and_decode_do_not_import_each_other():
    for own, other in (("prefill", "decode"), ("decode", "prefill")):
        for path in (REPO / own).rglob("*.py"):
            assert not [m for m in TREE.imports(path) if area_of(m) == other], path


def test_cluster_parts_import_without_cycles():
    assert not TREE.cluster_cycles()


def test_shipped_code_imports_no_test_code():
    assert not TREE.test_only_imports()


def test_every_folder_of_modules_is_a_package_the_wheel_ships():
    assert not TREE.folders_outside_the_wheel()


def test_every_package_folder_has_a_readme():
    assert not TREE.folders_without_readme()


@pytest.mark.parametrize("folder", TREE.package_folders, ids=lambda p: str(p.relative_to(REPO)))
def test_folder_readme_names_its_modules_and_nothing_that_is_not_there(folder):
    readme = folder.relative_to(REPO) / "README.md"
    assert not TREE.unnamed_modules(folder), f"{readme} does not name {TREE.unnamed_modules(folder)}"
    assert not TREE.readme_dead_entries(folder), f"{readme} names what is not there: {TREE.readme_dead_entries(folder)}"


def test_architecture_links_every_top_level_readme():
    assert not TREE.unlinked_readmes(DOC), f"docs/ARCHITECTURE.md does not link {TREE.unlinked_readmes(DOC)}"


def test_architecture_names_nothing_that_is_not_there():
    missing = TREE.missing_doc_targets(DOC)
    assert not missing, f"docs/ARCHITECTURE.md names what does not exist: {missing}"


def test_the_request_lifecycle_names_nothing_that_is_not_there():
    missing = TREE.missing_doc_targets(REPO / "docs" / "structures.md")
    assert not missing, f"docs/structures.md names what does not exist: {missing}"


# ---- the checker catches what it is for: each rule, with a violation planted ----------------


@pytest.fixture
def planted(tmp_path):
    """A copy of the source tree and the doc that a self-test may break."""
    for package in ("engine", "kvtransfer", "runtime", "prefill", "decode", "cluster", "proto"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "docs").mkdir()
    shutil.copy(DOC, tmp_path / "docs" / "ARCHITECTURE.md")
    return tmp_path


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


def test_the_checker_sees_upward_relative_and_lazy_imports():
    source = (REPO / "engine" / "core" / "block_pool.py").read_text()
    planted = source + "\ndef f():\n    import torch\n    from ...cluster.config import ServeConfig\n"
    imports = parse_imports(planted, "splitserve.engine.core")
    assert "torch" in imports and "splitserve.cluster.config" in imports
    assert area_of("splitserve.cluster.config") not in ALLOWED["engine"]
    assert area_of("splitserve.proto.messages.handoff") == MESSAGES and area_of("splitserve.proto.stubs") == "proto"


def test_the_checker_catches_an_upward_import(planted):
    _append(planted / "proto" / "messages" / "handoff.py", "\nfrom splitserve.engine.config import EngineConfig\n")
    tree = SourceTree(planted)
    assert tree.flow_violations(planted / "proto" / "messages" / "handoff.py") == [
        "splitserve.engine.config",
        "splitserve.engine.config.EngineConfig",
    ]


def test_type_checking_is_the_guard_not_a_substring():
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    assert "torch" not in parse_imports(guarded, "x")
    assert "torch" in parse_imports("import typing\nif typing.TYPE_CHECKING:\n    pass\nelse:\n    import torch\n", "x")
    assert "torch" in parse_imports("if not TYPE_CHECKING:\n    import torch\n", "x")
    assert "torch" in parse_imports("if NOT_TYPE_CHECKING_REALLY:\n    import torch\n", "x")


def test_the_checker_follows_parent_init_imports(planted):
    """engine/core imports nothing heavy itself; a parent package's __init__ that imports torch
    runs on every import of it and is seen."""
    _append(planted / "engine" / "__init__.py", "\nimport torch\n")
    found = SourceTree(planted).heavy_reached("engine/core")
    assert found and "splitserve.engine (imported by" in found[0]


def test_the_checker_follows_lazy_export_maps(planted):
    """proto/messages reaches torch if its package's lazy-export map names a torch module."""
    _append(
        planted / "proto" / "messages" / "__init__.py",
        '\n_EXPORTS = {"KVTransport": "splitserve.kvtransfer.transport"}\n',
    )
    tree = SourceTree(planted)
    assert "splitserve.kvtransfer.transport" in tree.imports(planted / "proto" / "messages" / "__init__.py")
    found = tree.heavy_reached("proto/messages")
    assert found and "splitserve.kvtransfer.transport" in " ".join(found)


def test_the_checker_catches_a_cluster_cycle(planted):
    _append(
        planted / "cluster" / "control" / "pool_metrics.py",
        "\nfrom splitserve.cluster.frontend.metrics import Metrics\n",
    )
    cycles = SourceTree(planted).cluster_cycles()
    assert any("splitserve.cluster.control" in c and "splitserve.cluster.frontend" in c for c in cycles), cycles


def test_the_checker_catches_shipped_code_importing_test_code(planted):
    _append(planted / "cluster" / "default_model.py", "\nfrom tests.helpers.model import make_checkpoint\n")
    assert SourceTree(planted).test_only_imports()


def test_the_checker_catches_a_dead_doc_entry(planted):
    doc = planted / "docs" / "ARCHITECTURE.md"
    before = set(SourceTree(planted).missing_doc_targets(doc))  # tests/, helm/ are not copied
    _append(doc, "\n- `engine/core/gone.py`, `gone.py`, `engine/gone/`, [gone](gone_research.md)\n")
    assert [m for m in SourceTree(planted).missing_doc_targets(doc) if m not in before] == [
        "engine/core/gone.py",
        "gone.py",
        "engine/gone/",
        "gone_research.md",
    ]


def test_the_checker_catches_an_unnamed_module_and_a_dead_readme_entry(planted):
    core = planted / "engine" / "core"
    tree = SourceTree(planted)
    assert tree.unnamed_modules(core) == [] and tree.readme_dead_entries(core) == []
    (core / "planted_module.py").write_text('"""A module the README does not name."""\n')
    # block_pool.py named only by a longer name does not count; gone.py, sub/gone.py, a dead link do
    text = (core / "README.md").read_text().replace("`block_pool.py`", "`old_block_pool.py`")
    (core / "README.md").write_text(text + "\n- `gone.py`, `sub/gone.py` — [gone](gone.md)\n")
    tree = SourceTree(planted)
    assert tree.unnamed_modules(core) == ["block_pool.py", "planted_module.py"]
    assert tree.readme_dead_entries(core) == ["old_block_pool.py", "gone.py", "sub/gone.py", "gone.md"]


def test_the_checker_catches_a_module_named_in_another_folders_readme(planted):
    """A module named by bare file name counts only in its own folder's README."""
    before = set(SourceTree(planted).readme_dead_entries(planted / "engine"))  # tests/ is not copied
    text = (planted / "engine" / "README.md").read_text()
    (planted / "engine" / "README.md").write_text(text.replace("`engine_loop.py`", "`core/engine_loop.py`"))
    (planted / "engine" / "core" / "README.md").write_text(
        (planted / "engine" / "core" / "README.md").read_text() + "\n- `engine_loop.py` — the engine loop\n"
    )
    tree = SourceTree(planted)
    assert tree.unnamed_modules(planted / "engine") == ["engine_loop.py"]
    assert [m for m in tree.readme_dead_entries(planted / "engine") if m not in before] == ["core/engine_loop.py"]
    assert tree.readme_dead_entries(planted / "engine" / "core") == ["engine_loop.py"]


def test_the_checker_catches_a_folder_without_readme_and_an_unlinked_one(planted):
    doc = planted / "docs" / "ARCHITECTURE.md"
    assert SourceTree(planted).folders_without_readme() == []
    (planted / "engine" / "core" / "README.md").unlink()
    (planted / "engine" / "planted").mkdir()
    (planted / "engine" / "planted" / "__init__.py").write_text("")
    (planted / "engine" / "planted" / "x.py").write_text("")
    assert SourceTree(planted).folders_without_readme() == ["engine/core", "engine/planted"]
    assert SourceTree(planted).unlinked_readmes(doc) == []
    (planted / "engine" / "planted" / "__init__.py").unlink()
    assert SourceTree(planted).folders_outside_the_wheel() == ["engine/planted"]
    doc.write_text(doc.read_text().replace("(../kvtransfer/README.md)", "(../kvtransfer/)"))
    assert SourceTree(planted).unlinked_readmes(doc) == ["kvtransfer/README.md"]


def test_a_simulated_replica_never_imports_torch(tiny_model):
    """A fresh interpreter imports both workers, builds a simulated engine (tokenizer and
    config of a real checkpoint) with its KV link, and runs a request: no torch anywhere."""
    code = f"""
import sys
from splitserve.decode.decode_worker import DecodeWorker
from splitserve.prefill.prefill_worker import PrefillWorker
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine_factory import build_engine
from splitserve.proto.messages.sampling_params import SamplingParams
from splitserve.kvtransfer.data_plane import data_plane_for
from splitserve.kvtransfer.protocols import ReceiveOrder
engine = build_engine(EngineConfig(model={tiny_model!r}, engine="simulated", profile="llama-8b-h200"))
plane = data_plane_for(engine.config)
transport = plane.open_transport("p", engine, "127.0.0.1", 5.0)
plane.make_sender(transport, engine).close()
plane.post_receive(transport, engine, ReceiveOrder("d", 1, (0, 1), True)).complete(1.0)
assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids) == 3
print(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
