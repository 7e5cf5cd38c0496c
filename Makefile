# afd developer commands. `make test` and `make run` install what is missing first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.afd-installed
# The lock: every package `make setup` installs, pinned with hashes (pip-tools' pip-compile output, made by
# `make lock` from pyproject.toml and requirements.in). pyproject.toml keeps ranges for those who install afd
# as a library; the venv, CI and every test run take the lock's versions, so a new release upstream changes
# nothing here until `make lock` takes it in (`make test-latest` tries the newest releases on purpose).
LOCK := requirements.txt
# Its torch is the CPU build, 2.13.0+cpu, which this project's machines keep on disk (pip's find-links). Where
# it is not, name PyTorch's CPU index: `make setup PIP_LOCK_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"`.
# A GPU machine's venv needs a CUDA build put in place of it afterwards
# (`.venv/bin/pip install --force-reinstall torch==2.13.0 --index-url https://download.pytorch.org/whl/cuXXX`,
# XXX a CUDA version its driver supports): `make test-device` fails there until then, and says so.
PIP_LOCK_ARGS ?=
# make lock: `--upgrade` takes the newest release of everything the ranges admit; LOCK_ARGS="--upgrade-package
# transformers" moves one package alone.
LOCK_ARGS ?= --upgrade
# make test-latest: its own venv, the newest release of every package pyproject.toml names. torch stays the
# lock's: PyPI's newest Linux torch is a CUDA build of several GB; LATEST_TORCH=torch floats it too.
LATEST_VENV ?= .venv-latest
LATEST_TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
# make test's workers (pytest-xdist), on 2 cores. On 2026-12-07's machine (an Intel Xeon with AVX-512) the parallel
# part took 385-391 s on two workers before the changes to `suite` below and 356-364 s after, when three took 398 s:
# each node then paid torch's import, and more workers only added processes. Forking nodes from
# afd/cluster/forkserver.py (torch imported once per launcher) brought two workers to 280-310 s, with the cores
# ~80 % busy (the cases wait on sleeps, heartbeats and deadlines), and three then fill those waits: in one run
# each, two 309.7 s, three 270.5 s, four 277.9 s (same CPU time, 8m40s). Since then the only attention node's
# longer idle backoff, the fork server's frozen preload and forked test helpers took three workers to 242.8 s
# (7m41s of CPU against 8m31s; four took 329 s in a run before the last two). The few cases that compare time
# shares (`serial`, 6-9 s) run after, alone. PYTEST_WORKERS=0 runs the parallel part in this process.
PYTEST_WORKERS ?= 3

.PHONY: setup vendor-hash lock suite test-latest test test-avx2 test-slow test-device fuzz run lint typecheck format clean proto

# The vendor wheels of requirements-vendor.txt (torch_npu's): see $(VENDOR_STAMP) below.
VENDOR_LOCK := requirements-vendor.txt
VENDOR_DIR := .cache/vendor
VENDOR_STAMP := $(VENDOR_DIR)/.downloaded
VENDOR_PLATFORM := --only-binary :all: --platform manylinux_2_28_x86_64 --python-version 3.11 --implementation cp

setup: $(STAMP) $(VENDOR_STAMP)

# The vendor wheels of requirements-vendor.txt (torch_npu's), downloaded once, checked against their hashes, for
# the tests that hold afd's device code and the fakes to them (tests/test_vendor_npu.py). Not installed.
$(VENDOR_STAMP): $(VENDOR_LOCK) | $(STAMP)
	@echo "setup: the vendor wheels of $(VENDOR_LOCK), once, into $(VENDOR_DIR) (read by the tests, not installed)"
	$(BIN)/python -m pip download --quiet --no-deps --require-hashes $(VENDOR_PLATFORM) $(PIP_LOCK_ARGS) \
		-d $(VENDOR_DIR) -r $(VENDOR_LOCK)
	touch $(VENDOR_STAMP)

# The line for requirements-vendor.txt after a version change there: the wheel's hash, from the index.
vendor-hash: $(STAMP)
	rm -rf $(VENDOR_DIR)/new && $(BIN)/python -m pip download --quiet --no-deps $(VENDOR_PLATFORM) \
		-d $(VENDOR_DIR)/new $$(sed -n 's/^\(torch_npu==[^ ]*\).*/\1/p' $(VENDOR_LOCK))
	@for f in $(VENDOR_DIR)/new/*.whl; do echo "$$f: --hash=sha256:$$(sha256sum $$f | cut -d' ' -f1)"; done

# The first install takes a minute or two: each step says what it does, and pip names each package it takes.
$(STAMP): $(LOCK) pyproject.toml
	@echo "setup 1/3: the venv in $(VENV) (once; then every command of the README runs as $(BIN)/afd, or after source $(BIN)/activate)"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -c 'import sys; v = "%d.%d" % sys.version_info[:2]; sys.exit(None if v == "3.11" else \
		f"$(LOCK) is locked for CPython 3.11 and $(VENV) has {v}: make clean setup PY=python3.11, or make lock for {v}")'
	@echo "setup 2/3: every package from the lock, $(LOCK): pinned with hashes, torch the largest"
	$(BIN)/python -m pip install --progress-bar off --require-hashes $(PIP_LOCK_ARGS) -r $(LOCK)
	@echo "setup 3/3: afd itself (editable, with the lock's setuptools), and nothing the lock does not name"
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	$(BIN)/python tests/venv_lock.py --sync
	touch $(STAMP)

# Refresh the lock from pyproject.toml's ranges and requirements.in (a few minutes: pip-compile asks the index
# for every file's hash). Then `make setup` installs it and `make test` says whether it holds.
lock: setup
	CUSTOM_COMPILE_COMMAND="make lock" $(BIN)/pip-compile $(LOCK_ARGS) --generate-hashes --allow-unsafe \
		--strip-extras --extra test --extra fuzz --no-emit-index-url --no-emit-find-links \
		--output-file $(LOCK) pyproject.toml requirements.in

test: setup lint typecheck
	@command -v prometheus >/dev/null || echo "note: prometheus is not installed; its end-to-end test will skip (install: bash .ci/prometheus.sh, or apt-get install prometheus)"
	$(MAKE) --no-print-directory suite

# make test's pytest runs, on BIN's interpreter (make test-latest passes its own).
# make test starts about 250 Python processes (node processes most, forked from a server that has imported
# torch: afd/cluster/forkserver.py), so what each pays at start is what counts. Python caches compiled bytecode, and pytest its assertion-rewritten test modules, only where
# PYTHONDONTWRITEBYTECODE is unset; this project's machines set it, so the suite's runs unset it (the
# caches are __pycache__/, which git ignores, and a stale one is recompiled, never used), and compileall
# fills afd's before the first node starts: without them a node compiled afd's ~120 modules again (about
# 0.2 s of CPU) and each pytest process rewrote ~400 test modules (about 4 s). --dist loadscope sends a
# module's cases to one worker, so its module-scoped clusters start once, not once per worker.
SUITE_ENV := env -u PYTHONDONTWRITEBYTECODE
# tests/conftest.py's SERIAL_MODULES, by file: the serial run collects these alone, not all ~2000 cases (8 s).
SERIAL_TESTS := tests/test_metrics_truth.py
suite:
	$(SUITE_ENV) $(BIN)/python -m compileall -q afd attention_node ffn_node
	$(SUITE_ENV) $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope -m "not slow and not serial" $(PYTEST_ARGS)
	$(SUITE_ENV) $(BIN)/python -m pytest -q -m "serial and not slow" $(PYTEST_ARGS) $(SERIAL_TESTS)

# The suite against the newest releases, in a venv of its own ($(LATEST_VENV)), so that an upstream change is
# seen on purpose: it first lists each package whose version there differs from the lock.
test-latest: $(VENDOR_STAMP)
	test -x $(LATEST_VENV)/bin/python || $(PY) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install --quiet --upgrade pip setuptools wheel
	$(LATEST_VENV)/bin/python -m pip install --progress-bar off --upgrade --upgrade-strategy eager \
		"$(LATEST_TORCH)" -e ".[test,fuzz]"
	$(LATEST_VENV)/bin/python tests/venv_lock.py --compare
	$(MAKE) --no-print-directory suite BIN=$(LATEST_VENV)/bin

# schemathesis against /openapi.json of a demo cluster, FUZZ_EXAMPLES cases per operation drawn from FUZZ_SEED
# (915 requests, 1 to 3 minutes on 2 cores): no 5xx, nothing off-schema, and the cluster answers as before
# afterwards. A fixed count and seed make a run reproducible, whatever the machine's speed; `make fuzz
# FUZZ_SEED=7` draws other cases. CI runs it after `make test`.
FUZZ_SEED ?= 1
FUZZ_EXAMPLES ?= 60
fuzz: setup
	$(BIN)/python tests/fuzz_api.py --seed $(FUZZ_SEED) --max-examples $(FUZZ_EXAMPLES)

# The numerics tests again with the CPU kernels held to AVX2 (ATen's dispatch, MKL and oneDNN): the kernels a
# CPU other than this one may take, so that a tolerance or a bit-equality that holds only on this CPU fails here.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
test-avx2: setup
	$(SUITE_ENV) $(AVX2_ENV) $(BIN)/python -m pytest -q -m "numerics and not slow" $(PYTEST_ARGS)

test-slow: setup
	$(SUITE_ENV) $(BIN)/python -m pytest -q -m slow --timeout 900 $(PYTEST_ARGS)

# On a CUDA GPU or an Ascend NPU (torch_npu in the venv): afd on the device against the CPU reference, at most
# 8 minutes on one device (tests/device/check.py says what it checks); the table is printed and written to
# docs/bench/device/. Without an accelerator every device check skips with its reason, nothing is written, and
# it exits 0; a GPU or NPU that torch cannot use (the CPU wheel, no torch_npu) fails it in one line, as nothing
# would run. DEVICE_CHECK_ARGS: e.g. --checks gemm, --quick, --no-write, --device cpu (a dry run on the CPU).
# It installs nothing over a device machine's own stack: tests/device/device_venv.py runs check.py in a venv that
# sees the machine's torch (CUDA, or torch_npu on CANN) when that torch can run afd, adding only what the lock
# names and the machine lacks (it says which; WHEELS=DIR: from that folder, for a machine with no index), and in
# make setup's CPU venv otherwise. DEVICE_VENV_ARGS=--dry-run says what it would do and does nothing.
DEVICE_CHECK_ARGS ?=
DEVICE_VENV ?= .venv-device
DEVICE_VENV_ARGS ?=
WHEELS ?=
test-device:
	$(PY) tests/device/device_venv.py --venv $(DEVICE_VENV) --cpu-venv $(VENV) $(if $(WHEELS),--wheels $(WHEELS)) \
		$(DEVICE_VENV_ARGS) -- $(DEVICE_CHECK_ARGS)

run: setup
	$(BIN)/afd launch deploy/local.yaml --curl-example

# ruff's lint and format checks (`make format` applies the formatting).
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy over the packages pyproject's [tool.mypy] names; make test runs it.
typecheck: setup
	$(BIN)/mypy

format: setup
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) $(LATEST_VENV) .pytest_cache .ruff_cache *.egg-info

# Regenerate the committed gRPC stubs from proto/ (tests/test_proto.py fails when they are stale).
proto: setup
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/afd/control/control.proto
