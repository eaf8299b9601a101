# splitserve: `make serve` and `make test` are all a fresh machine needs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_USAGE_STATS_ENABLED := 0
# Python's default, bytecode cached in __pycache__, even where the environment turns it off (this
# machine's image sets PYTHONDONTWRITEBYTECODE=1): the suite imports the repository's
# modules in hundreds of processes (xdist workers, Ray workers, `splitserve serve`), and without
# the cache each of them compiles every module again (and pytest rewrites every test module's
# asserts again): ~5 CPU-s per collecting worker alone.
unexport PYTHONDONTWRITEBYTECODE

GPU_PY ?= python3
GPU_CHECK_OUT ?= bench/results/gpu_check
GPU_CHECK_CPU_OUT ?= $(or $(TMPDIR),/tmp)/splitserve-gpu-check

# Test tiers (markers set in tests/conftest.py, see README "Development"): unit, cluster, e2e.
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25
# `make test` and `make test-fast` run on TEST_WORKERS pytest-xdist workers (tests/conftest.py): the
# tests that start `splitserve serve`, HAProxy or Postgres (the xdist group "serial") on one of them,
# one at a time, the rest of the cluster tier (the group "ray", on that worker's own Ray instance) on
# another, and the unit tier on whichever is free. Three workers on 2 cores: with two, the CPUs sat
# ~16 % idle (the tests wait on probes, restarts and streams), which the third fills with unit tests.
# TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= 3
PYTEST_PARALLEL := $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup

.PHONY: install lint typecheck test test-fast test-cluster test-e2e serve proto clean gpu-check gpu-check-cpu gpu-check-wheels

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# Exactly torch 2.13.0 first: a looser spec would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

proto: install
	$(BIN)/python -m splitserve.proto.build

lint: install typecheck
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy (pyproject.toml [tool.mypy]): the packages install as splitserve.<folder>, so mypy reads
# them through links under build/typecheck/splitserve/.
TYPECHECK_PACKAGES := engine kvtransfer runtime prefill decode cluster proto
typecheck: install
	@mkdir -p build/typecheck/splitserve
	@for p in $(TYPECHECK_PACKAGES); do ln -sfn ../../../$$p build/typecheck/splitserve/$$p; done
	$(BIN)/mypy

test: install lint
	$(PYTEST_PARALLEL) tests

# The everyday loop: the unit tier (no Ray, no `splitserve serve`), under 3 minutes on 2 cores.
test-fast: install
	$(PYTEST_PARALLEL) -m "unit and not slow" tests

test-cluster: install
	$(PYTEST) -m "cluster and not slow" tests

test-e2e: install
	$(PYTEST) -m "e2e and not slow" tests

serve: install
	$(BIN)/splitserve serve

# The GPU path in one run on a CUDA machine, no venv and no network: torch, triton, transformers,
# safetensors and tokenizers must be importable by $(GPU_PY). See bench/README.md.
gpu-check:
	$(GPU_PY) bench/gpu_check/gpu_check.py $(GPU_CHECK_OUT)

# The wheels a lent GPU machine lacks (msgspec, pydantic, ...), into .whl/ to carry there.
gpu-check-wheels: install
	$(BIN)/python bench/gpu_check/device_wheels.py .whl

# The same checks at tiny sizes on CPU, Triton interpreted (CI runs this in tests/bench).
gpu-check-cpu: install
	$(BIN)/python bench/gpu_check/gpu_check.py $(GPU_CHECK_CPU_OUT) --device cpu --tiny

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
