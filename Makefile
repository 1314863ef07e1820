# Two commands do everything on a fresh machine:
#   make audit   set up, then run the default sweep on the embedded model and print the table
#   make test    set up, then run the test suite (what CI runs)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.detaudit-installed

.PHONY: setup audit test clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

audit: setup
	$(VENV)/bin/detaudit sweep --output-path runs/default

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) .cache-test runs
