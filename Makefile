# afd developer commands. `make test` and `make run` install what is missing first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.afd-installed
# The CPU wheel of this version is on the build machines' disk; an unpinned torch pulls a CUDA build.
# The pin is the version, not the build: pip takes the build this machine's sources offer (+cpu here; PyPI's
# Linux wheel is a CUDA build). A GPU machine whose venv got the CPU wheel needs a CUDA build put in its place
# (`.venv/bin/pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cuXXX`,
# XXX a CUDA version its driver supports): `make test-device` fails there until then, and says so.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# make test's workers (pytest-xdist): two workers keep both cores busy (~93 % on 2 cores; the parallel part
# took 257 s on 2026-12-02; three workers gained 3 %); the few cases that compare time shares (`serial`) run
# after, alone. PYTEST_WORKERS=0 runs the parallel part in this process.
PYTEST_WORKERS ?= 2

.PHONY: setup test test-avx2 test-slow test-device fuzz run lint typecheck format clean proto

setup: $(STAMP)

# The first install takes a minute or two: each step says what it does, and pip names each package it takes.
$(STAMP): pyproject.toml
	@echo "setup 1/3: the venv in $(VENV) (once; then every command of the README runs as $(BIN)/afd, or after source $(BIN)/activate)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "setup 2/3: $(TORCH_SPEC) (the largest package)"
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	@echo "setup 3/3: afd and what it and its tests use (pyproject.toml); pip names each package"
	$(BIN)/python -m pip install --progress-bar off -e ".[test]"
	touch $(STAMP)

test: setup lint typecheck
	@command -v prometheus >/dev/null || echo "note: prometheus is not installed; its end-to-end test will skip (install: bash .ci/prometheus.sh, or apt-get install prometheus)"
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -m "not slow and not serial" $(PYTEST_ARGS)
	$(BIN)/python -m pytest -q -m "serial and not slow" $(PYTEST_ARGS)

# schemathesis against /openapi.json of a demo cluster, FUZZ_EXAMPLES cases per operation drawn from FUZZ_SEED
# (915 requests, 1 to 3 minutes on 2 cores): no 5xx, nothing off-schema, and the cluster answers as before
# afterwards. A fixed count and seed make a run reproducible, whatever the machine's speed; `make fuzz
# FUZZ_SEED=7` draws other cases. CI runs it after `make test`.
FUZZ_SEED ?= 1
FUZZ_EXAMPLES ?= 60
fuzz: setup
	$(BIN)/python -m pip install --quiet "schemathesis>=4.30"
	$(BIN)/python tests/fuzz_api.py --seed $(FUZZ_SEED) --max-examples $(FUZZ_EXAMPLES)

# The numerics tests again with the CPU kernels held to AVX2 (ATen's dispatch, MKL and oneDNN): the kernels a
# CPU other than this one may take, so that a tolerance or a bit-equality that holds only on this CPU fails here.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
test-avx2: setup
	$(AVX2_ENV) $(BIN)/python -m pytest -q -m "numerics and not slow" $(PYTEST_ARGS)

test-slow: setup
	$(BIN)/python -m pytest -q -m slow --timeout 900 $(PYTEST_ARGS)

# On a CUDA GPU or an Ascend NPU (torch_npu in the venv): afd on the device against the CPU reference, at most
# 8 minutes on one device (tests/device/check.py says what it checks); the table is printed and written to
# docs/bench/device/. Without an accelerator every device check skips with its reason, nothing is written, and
# it exits 0; a GPU or NPU that torch cannot use (the CPU wheel, no torch_npu) fails it in one line, as nothing
# would run. DEVICE_CHECK_ARGS: e.g. --checks gemm, --quick, --no-write, --device cpu (a dry run on the CPU).
DEVICE_CHECK_ARGS ?=
test-device: setup
	$(BIN)/python tests/device/check.py $(DEVICE_CHECK_ARGS)

run: setup
	$(BIN)/afd launch deploy/local.yaml --curl-example

# ruff's lint and format checks (`make format` applies the formatting).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy over the packages pyproject's [tool.mypy] names (afd/engine, afd/dataplane, afd/model); make test runs it.
typecheck: setup
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info

# Regenerate the committed gRPC stubs from proto/ (tests/test_proto.py fails when they are stale).
proto: setup
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/afd/control/control.proto
