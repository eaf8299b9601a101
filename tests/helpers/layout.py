"""The layout rules tests/test_layout.py holds, as functions of a source tree: the repo, or a
temporary copy a self-test plants a violation in. Read from the source (ast), not from what
happens to be imported at test time, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
import re
from functools import cached_property
from pathlib import Path

PACKAGES = ("engine", "kvtransfer", "runtime", "prefill", "decode", "cluster", "proto", "bench")
# The message package is its own area: the bottom layer, which every other package may import.
MESSAGES = "proto.messages"
# What each area may import from splitserve (besides itself):
# cluster -> prefill/decode -> runtime -> kvtransfer -> engine -> proto.messages; proto (the gRPC
# API) is for cluster only; bench sits on top.
ALLOWED = {
    MESSAGES: set(),
    "proto": set(),
    "engine": {MESSAGES},
    "kvtransfer": {"engine", MESSAGES},
    "runtime": {"kvtransfer", "engine", MESSAGES},
    "prefill": {"runtime", "kvtransfer", "engine", MESSAGES},
    "decode": {"runtime", "kvtransfer", "engine", MESSAGES},
    "cluster": {"prefill", "decode", "runtime", "kvtransfer", "engine", "proto", MESSAGES},
    "bench": {"cluster", "prefill", "decode", "runtime", "kvtransfer", "engine", "proto", MESSAGES},
}
TORCH_FREE = ("engine/core", "cluster/routing", "proto/messages", "engine/simulated", "cluster/planning")
HEAVY = ("torch", "triton")
# Module-level dicts in an __init__ that map an attribute to the module it loads on first use
# (PEP 562 __getattr__): each value counts as an import of that package.
LAZY_EXPORT_MAPS = ("_EXPORTS",)
TEST_CODE = "tests"  # the test suite (tests/helpers/ ...): importable from a checkout, never installed
README = "README.md"  # each package folder's: what the folder is for, its layer, a line per module
PLUMBING = ("__init__.py", "__main__.py")
# A backticked path or file name in a doc (`engine/core/x.py`, `gone.py`, `cluster/deploy/`) and
# a relative link's target ([x](GPU.md#anchor) -> GPU.md).
_DOC_PATH = re.compile(r"`([A-Za-z0-9_./-]+(?:\.(?:py|proto|md|yaml|toml)|/))`")
_MODULE_PATH = re.compile(r"`([A-Za-z0-9_./-]+\.py)`")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:` -- the guard itself, not any test that
    mentions the name (`if not TYPE_CHECKING:` runs at import time)."""
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING" and isinstance(test.value, ast.Name)


def _runtime_nodes(tree: ast.AST):
    """Every node but those only type checkers see (the body of an `if TYPE_CHECKING:`; its
    else branch runs)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += [node.test, *node.orelse]
        else:
            todo += list(ast.iter_child_nodes(node))


def _lazy_exports(tree: ast.Module) -> list[str]:
    found = []
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id in LAZY_EXPORT_MAPS for t in targets) and isinstance(
            node.value, ast.Dict
        ):
            found += [v.value for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    return found


def parse_imports(source: str, package: str) -> tuple[str, ...]:
    """Every module the source imports at run time, at any depth, absolute, plus the modules a
    lazy-export map names; package: the package relative imports start from."""
    tree = ast.parse(source)
    found = _lazy_exports(tree)
    for node in _runtime_nodes(tree):
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


def area_of(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "splitserve" or parts[1] not in PACKAGES:
        return None
    return MESSAGES if parts[1:3] == ["proto", "messages"] else parts[1]


class SourceTree:
    def __init__(self, root: Path):
        self.root = root
        self._imports: dict[Path, tuple[str, ...]] = {}

    @cached_property
    def files(self) -> list[Path]:
        files = []
        for package in PACKAGES:
            if (self.root / package).is_dir():
                files += [p for p in (self.root / package).rglob("*.py") if "_pb2" not in p.name]
        return sorted(files)

    @cached_property
    def modules(self) -> dict[str, Path]:
        return {self.module_name(p): p for p in self.files}

    def module_name(self, path: Path) -> str:
        parts = list(path.relative_to(self.root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        return "splitserve." + ".".join(parts)

    def imports(self, path: Path) -> tuple[str, ...]:
        if path not in self._imports:
            name = self.module_name(path)
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            self._imports[path] = parse_imports(path.read_text(), package)
        return self._imports[path]

    def flow_violations(self, path: Path) -> list[str]:
        own = area_of(self.module_name(path))
        return sorted({m for m in self.imports(path) if (a := area_of(m)) and a != own and a not in ALLOWED[own]})

    def _executed(self, module: str) -> list[str]:
        """What importing module runs: it and each parent package's __init__."""
        parts = module.split(".")
        return [name for i in range(2, len(parts) + 1) if (name := ".".join(parts[:i])) in self.modules]

    def reachable(self, start: str) -> dict[str, str]:
        """splitserve modules that importing start runs -> the module that imported each."""
        seen = dict.fromkeys(self._executed(start), start)
        todo = list(seen)
        while todo:
            module = todo.pop()
            for imported in self.imports(self.modules[module]):
                for executed in self._executed(imported):
                    if executed not in seen:
                        seen[executed] = module
                        todo.append(executed)
        return seen

    def heavy_reached(self, area: str) -> list[str]:
        """`start reaches module (imported by importer), which imports torch` for each module
        under area (a folder below the root) that reaches torch or triton."""
        starts = [m for m, p in self.modules.items() if p.is_relative_to(self.root / area)]
        assert starts, f"no modules under {area}"
        found = []
        for start in starts:
            for module, importer in self.reachable(start).items():
                heavy = [m for m in self.imports(self.modules[module]) if m.split(".")[0] in HEAVY]
                if heavy:
                    found.append(f"{start} reaches {module} (imported by {importer}), which imports {heavy}")
        return found

    def cluster_cycles(self) -> list[list[str]]:
        """Import cycles between cluster's parts (a subpackage, or a module at cluster's top)."""

        def part(module: str) -> str | None:
            parts = module.split(".")
            return ".".join(parts[:3]) if parts[:2] == ["splitserve", "cluster"] and len(parts) > 2 else None

        graph: dict[str, set[str]] = {}
        for module, path in self.modules.items():
            if (src := part(module)) is not None:
                targets = {p for m in self.imports(path) if (p := part(m)) and p != src and self._executed(m)}
                graph.setdefault(src, set()).update(targets)
        cycles, state, stack = [], {}, []

        def visit(node: str) -> None:
            state[node] = "open"
            stack.append(node)
            for nxt in sorted(graph.get(node, ())):
                if state.get(nxt) == "open":
                    cycles.append(stack[stack.index(nxt) :] + [nxt])
                elif nxt not in state:
                    visit(nxt)
            stack.pop()
            state[node] = "done"

        for node in sorted(graph):
            if node not in state:
                visit(node)
        return cycles

    def test_only_imports(self) -> list[str]:
        """Shipped modules (every package, bench/ included) that import the test suite. What
        tests and benchmarks share lives in bench/, which only bench/ and the tests may import."""
        return [
            f"{name} imports {m}"
            for name, path in self.modules.items()
            for m in self.imports(path)
            if m == TEST_CODE or m.startswith(TEST_CODE + ".")
        ]

    @cached_property
    def package_folders(self) -> list[Path]:
        """Every folder of modules that is a package (has an `__init__.py`): each has a README.
        The benchmark drivers under bench/scripts/ are not a package; bench/README.md names them."""
        return sorted({p.parent for p in self.files if (p.parent / "__init__.py").is_file()})

    def folders_outside_the_wheel(self) -> list[str]:
        """Folders of shipped modules without an `__init__.py`: setup.py's find_packages skips
        them, so the editable install imports them and the built wheel does not (the benchmark
        drivers under bench/scripts/ are run from the repo root, not shipped)."""
        scripts = self.root / "bench" / "scripts"
        folders = {p.parent for p in self.files if scripts not in p.parents and p.parent != scripts}
        return sorted(f.relative_to(self.root).as_posix() for f in folders if not (f / "__init__.py").is_file())

    def folders_without_readme(self) -> list[str]:
        return [f.relative_to(self.root).as_posix() for f in self.package_folders if not (f / README).is_file()]

    def unnamed_modules(self, folder: Path) -> list[str]:
        """The folder's modules its README does not name in backticks by file name (the
        package plumbing, `__init__.py` and `__main__.py`, aside)."""
        text = (folder / README).read_text()
        modules = sorted(p.name for p in folder.glob("*.py") if p in self.files and p.name not in PLUMBING)
        return [name for name in modules if f"`{name}`" not in text]

    def readme_dead_entries(self, folder: Path) -> list[str]:
        """What the folder's README names that is not there: a module by bare file name
        (`name.py`) that is not in the folder, a module path (`sub/x.py`, `engine/x.py`) neither
        below the folder nor the repo root, a relative link to nothing."""
        doc = folder / README
        text = doc.read_text()
        missing = []
        for path in _MODULE_PATH.findall(text):
            if "/" in path:
                found = (folder / path).is_file() or (self.root / path).is_file()
            else:
                found = (folder / path).is_file()
            if not found:
                missing.append(path)
        return missing + _dead_links(doc, text)

    def unlinked_readmes(self, doc: Path) -> list[str]:
        """Top-level folders whose README.md the doc does not link."""
        linked = {(doc.parent / link).resolve() for link in _LINK.findall(doc.read_text())}
        return [
            f"{package}/{README}"
            for package in PACKAGES
            if (self.root / package).is_dir() and (self.root / package / README).resolve() not in linked
        ]

    def missing_doc_targets(self, doc: Path) -> list[str]:
        """What the doc names that is not there: a backticked repo path (`engine/core/x.py`,
        `cluster/deploy/`) or file name, a relative link ([x](GPU.md))."""
        text = doc.read_text()
        missing = []
        for path in _DOC_PATH.findall(text):
            if path.endswith("/"):
                found = (self.root / path).is_dir()
            elif "/" in path:
                found = (self.root / path).exists()
            elif path.endswith(".md"):
                found = (doc.parent / path).exists() or (self.root / path).exists()
            else:  # a bare file name: some file of that name
                found = any(p.name == path for p in self.files)
            if not found:
                missing.append(path)
        return missing + _dead_links(doc, text)


def _dead_links(doc: Path, text: str) -> list[str]:
    return [link for link in _LINK.findall(text) if "://" not in link and not (doc.parent / link).exists()]
