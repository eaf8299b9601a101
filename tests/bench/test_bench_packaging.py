"""bench/ as a separately installed part: `splitserve bench` comes through an entry point (the
cluster never imports bench), and without the `bench` extra the benchmarks say how to get it."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from splitserve.bench import INSTALL_HINT, MissingBenchDependency, require_extra

REPO_ROOT = Path(__file__).resolve().parents[2]
# Makes `import matplotlib` / `import tqdm` fail as if the `bench` extra were not installed.
WITHOUT_EXTRA = "import sys\nsys.modules.update(matplotlib=None, tqdm=None)\n"


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def _cli(*argv: str, without_extra: bool = True) -> subprocess.CompletedProcess:
    code = (WITHOUT_EXTRA if without_extra else "import sys\n") + (
        "from splitserve.cluster.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    )
    return _python(code, *argv)


def test_cluster_never_imports_bench():
    offenders = []
    for path in (REPO_ROOT / "cluster").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(REPO_ROOT)}: {n}" for n in names if n.split(".")[:2] == ["splitserve", "bench"]
            ]
    assert offenders == []


def test_bench_is_a_registered_command_of_the_installed_distribution():
    from importlib.metadata import entry_points

    from splitserve.bench.cli import add_bench_parser
    from splitserve.cluster.cli.main import COMMAND_GROUP

    (bench,) = [point for point in entry_points(group=COMMAND_GROUP) if point.name == "bench"]
    assert bench.load() is add_bench_parser


def test_help_lists_bench_and_bench_help_works_without_the_extra():
    top = _cli("--help")
    assert top.returncode == 0, top.stderr
    assert "bench" in top.stdout and "serve" in top.stdout
    bench = _cli("bench", "--help")
    assert bench.returncode == 0, bench.stderr
    assert "--compare" in bench.stdout and "--ttft-slo-ms" in bench.stdout


def test_console_script_and_python_m_run_bench():
    script = Path(sys.executable).with_name("splitserve")
    if script.exists():
        run = subprocess.run([str(script), "bench", "--help"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "--compare" in run.stdout, run.stderr
    module = subprocess.run(
        [sys.executable, "-m", "splitserve.bench", "--help"], capture_output=True, text=True, timeout=120
    )
    assert module.returncode == 0 and "--compare" in module.stdout, module.stderr


def test_a_run_without_the_extra_stops_before_sending_and_names_the_extra(tmp_path):
    out = tmp_path / "out"
    run = _cli("bench", "--url", "http://127.0.0.1:9", "--num-requests", "1", "--out", str(out))
    assert run.returncode == 2
    assert INSTALL_HINT in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()  # nothing ran


@pytest.mark.parametrize(
    ("module", "blocked", "args"),
    [
        ("splitserve.bench.loadgen.report", "matplotlib", ["--help"]),
        ("splitserve.bench.serving.process_cpu_profile", "psutil", ["--help"]),
        # Plots only at the end of a run: the check comes first (tiny arguments in case it did not).
        (
            "splitserve.bench.kv_transfer.kv_transfer",
            "matplotlib",
            ["--presets", "tiny", "--lengths", "16", "--pair-reps", "1", "--raw-iters", "1", "--skip-actors"],
        ),
    ],
)
def test_bench_modules_run_without_the_extra_name_it(module, blocked, args, tmp_path):
    run = _python(
        f"""
        import runpy, sys
        sys.modules[{blocked!r}] = None
        sys.argv = [{module!r}, *{args!r}, *sys.argv[1:]]
        runpy.run_module({module!r}, run_name="__main__")
        """,
        *(["--out", str(tmp_path)] if "--skip-actors" in args else []),
    )
    assert run.returncode != 0
    assert f"need {blocked}, which is not installed: {INSTALL_HINT}" in run.stderr
    assert not list(tmp_path.iterdir())


def test_require_extra_explains_only_its_own_missing_module(tmp_path, monkeypatch):
    with pytest.raises(MissingBenchDependency, match=r"no_such_bench_dep.*pip install 'splitserve\[bench\]'"):
        require_extra("no_such_bench_dep.sub")
    # A dependency that is installed but itself imports something missing: the real error.
    (tmp_path / "broken_bench_dep.py").write_text("import no_such_module_below\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as caught:
        require_extra("broken_bench_dep")
    assert not isinstance(caught.value, MissingBenchDependency)
    assert caught.value.name == "no_such_module_below"
