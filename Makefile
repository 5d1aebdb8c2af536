# paperline: `make run` (install, start the local stack, run the demo) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PIP    := $(BIN)/python -m pip --disable-pip-version-check

.PHONY: install install-gpu gpu-check run test up down status clean

# The venv is rebuilt when the project's pins change.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# torch by pip: its CPU wheel lies on this machine's disk (pip's find-links), which uv does not read
	$(PIP) install -q -c constraints.txt torch==2.13.0 uv
	@# the rest by uv: the same pins and packages, their bytecode compiled as pip does, in 45 s against pip's 79 (caches warm, 2026-12-06)
	$(BIN)/uv pip install --python $(BIN)/python -q --compile-bytecode -c constraints.txt -e '.[test]'
	@# BoTorch's fused qLogEHVI kernel (C++, about 40 s to build), here rather than in the first NAS run
	$(BIN)/python -c 'from paperline.kernels.search.botorch_opt import load_fused_kernel as k; \
	  print("BoTorch fused qLogEHVI kernel:", "built" if k() else "not built (its PyTorch path is used)")'
	touch $(STAMP)

install: $(STAMP)

# GPU extra: dask-cuda, cudf and cupy pin dask and pandas, so they go in together in one command.
install-gpu: $(STAMP)
	$(PIP) install -q -c constraints-gpu.txt -e '.[test,gpu]'

# Every GPU check in one bounded run: the gpu tests, then the GPU benchmarks (tests/gpu/run_checks.sh),
# after `make install-gpu` (not re-run here: a GPU host may be offline).
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python tests/gpu/run_checks.sh

run: $(STAMP)
	$(BIN)/paperline up
	$(BIN)/paperline demo

# --max-worker-restart=0: a worker that crashes (a native abort) ends the run with that test failed;
# replaced instead, pytest-xdist re-ran the crashing test and then waited forever (2026-12-05).
test: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" -n 2 --dist loadgroup --no-loadscope-reorder --max-worker-restart=0 $(PYTEST_ARGS)

up: $(STAMP)
	$(BIN)/paperline up

down:
	@if [ -x $(BIN)/paperline ]; then $(BIN)/paperline down; fi

status: $(STAMP)
	$(BIN)/paperline status

clean: down
	rm -rf $(VENV) build *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
