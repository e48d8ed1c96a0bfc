# Everything runs from a virtual environment in .venv (Debian 12's system Python is externally managed).
# `make demo` installs the package alone; `make test` adds the [test,p4,torch,bench] extras (p4: p4runtime-shell
# and p4runtime for the BMv2 suites, which run where the P4 toolchain is installed and skip elsewhere).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install install-test demo test clean cuda

NATIVE_SOURCES := setup.py $(wildcard csrc/*.c csrc/*.h csrc/build_ffi.py csrc/cuda/*.cu csrc/cuda/*.cuh csrc/cuda/*.py)

# the C parts (csrc/) are built by cffi during pip install; DPDK's only where pkg-config finds libdpdk
$(VENV)/.base: pyproject.toml $(NATIVE_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

# Horovod 0.28.1 needs a patched sdist to build against torch 2.13; the wheel is cached in ~/.cache/ina-emulator
$(VENV)/.test: $(VENV)/.base tools/install-horovod.sh
	$(PY) -m pip install -q -e '.[test,p4,torch,bench]'
	bash tools/install-horovod.sh $(PY)
	$(PY) -m hostlib.integrations.futures  # the torch backend's future-error extension, built once (torch's cpp_extension cache)
	touch $@

install: $(VENV)/.base
install-test: $(VENV)/.test

# the CUDA kernels alone (pip install also builds them where nvcc exists): hostlib/_ina_cuda.so
cuda:
	$(PY) csrc/cuda/build_cuda.py

demo: $(VENV)/.base
	$(VENV)/bin/switchsim demo --workers 4 --size 4194304 --codec nc
	$(VENV)/bin/switchsim demo --workers 4 --size 4194304 --codec fixed
	$(VENV)/bin/switchsim demo --workers 4 --size 1048576 --codec int32 --loss 0.05
	$(VENV)/bin/switchsim demo --workers 4 --size 16777216 --codec nc --backend c
	$(VENV)/bin/switchsim demo --workers 4 --size 4194304 --codec int32 --sparse --density 0.01 --loss 0.02

# the tree's bytecode written once: each switch, rank and tool process the suite starts imports it, and where
# PYTHONDONTWRITEBYTECODE is set each would compile it afresh (~12 % of a process-heavy file's time)
test: $(VENV)/.test
	$(PY) -m compileall -q hostlib switchsim inaproto inabench inacli topologies tests > /dev/null
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
