# Every target sets itself up: a .venv with the pinned dependencies is made on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export GLOO_SOCKET_IFNAME ?= lo
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install test demo bench lint clean

$(STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# pip (not uv/poetry): it finds the local CPU wheel of torch==2.13.0.
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29517 \
		-m service.demo $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) -m bench.core
	$(PY) -m bench.ns
	$(PY) -m bench.api

lint: $(STAMP)
	$(VENV)/bin/ruff check dmuon service tests bench

clean:
	rm -rf $(VENV) .pytest_cache bench/results
