# Everything runs from a virtual environment in .venv (Debian 12's system Python is externally managed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install demo test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,torch]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/switchsim demo --workers 4 --size 4194304 --codec nc
	$(VENV)/bin/switchsim demo --workers 4 --size 4194304 --codec fixed --loss 0.05

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
