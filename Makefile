# Every target sets itself up: a .venv with the pinned dependencies is made on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# two stamps: the runtime (the demo, the CLI) and, on top of it, the test tools
RUN_STAMP := $(VENV)/.installed-run
STAMP  := $(VENV)/.installed
CHROMIUM ?= /usr/bin/chromium
WRK ?= /usr/bin/wrk
export OMP_NUM_THREADS ?= 1
export GLOO_SOCKET_IFNAME ?= lo
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install test demo demo-torchrun bench bench-overlap bench-ns-quality bench-convergence \
	bench-muon-variants bench-modes bench-compile bench-elastic-plan bench-tp-plan bench-ep-plan bench-ep-run \
	bench-gpu lint clean

$(RUN_STAMP): pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# pip (not uv/poetry): it finds the local CPU wheel of torch==2.13.0.
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(RUN_STAMP)

# the test tools (playwright, schemathesis, ...) for make test, the benches and lint
$(STAMP): $(RUN_STAMP) requirements-test.lock
	$(PY) -m pip install -q -r requirements-test.lock
	touch $(STAMP)

install: $(STAMP)

# the dashboard test drives Debian's Chromium (never a browser downloaded by a test tool)
$(CHROMIUM):
	apt-get install -y -qq chromium >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# bench/api.py loads the service with Debian's wrk (a C client: it leaves the CPU to the service)
$(WRK):
	apt-get install -y -qq wrk >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq wrk >/dev/null)

test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -q

# the control plane, its local Ray head and the default job (DEMO_EXIT_ON_FINISH=1: exit)
demo: $(RUN_STAMP)
	$(PY) -m service.dev.demo

# the DMuon core alone: 4 torchrun processes, no Ray, no service
demo-torchrun: $(RUN_STAMP)
	$(VENV)/bin/torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29517 \
		-m service.dev.torchrun_demo $(DEMO_ARGS)

bench: $(STAMP) $(WRK)
	$(PY) -m bench.core
	$(PY) -m bench.ns
	$(PY) -m bench.api

# 4 ranks in a network namespace whose loopback a tbf qdisc throttles (root; RATE=3gbit):
# 256 tokens per rank, then 4,096 with DMuon's FSDP2 at the root; then the same 4,096 on
# two hosts of two ranks, 200 Mbit/s per host link (about 30 minutes in all)
bench-overlap: $(STAMP)
	$(PY) -m bench.overlap --rate $(or $(RATE),3gbit) --rounds 6
	$(PY) -m bench.overlap --rate 370mbit --batch 16 --seq 256 --rounds 4 --steps 3 \
		--dmuon-fsdp root
	$(PY) -m bench.overlap --links nodes --rate 200mbit --batch 16 --seq 256 --rounds 4 \
		--steps 3 --dmuon-fsdp root

# Gram vs standard NS judged by training: 12 trainings of 300 steps (about 10 minutes here)
bench-ns-quality: $(STAMP)
	$(PY) -m bench.ns_quality

# DMuon vs AdamW on the built-in small model, LR-tuned, 3 seeds (about 20 minutes here)
bench-convergence: $(STAMP)
	$(PY) -m bench.convergence

# Plain Muon, QK-clip and NorMuon on the built-in small model, 5 runs of 200 steps on one
# thread (8 to 12 minutes here); writes a dated record in bench/results/
bench-muon-variants: $(STAMP)
	$(PY) -m bench.muon_variants

# dmuon.mode auto for Llama-3 8B / 70B on 1, 8, 64 GPUs of 80 GB (seconds)
bench-modes: $(STAMP)
	$(PY) -m bench.modes

# step time with and without torch.compile per block (a dated record in bench/results/)
bench-compile: $(STAMP)
	$(PY) -m bench.compile

# the elastic planner's table for Llama-3 8B / 70B on 1 to 8 hosts of 8 x 80 GB (seconds)
bench-elastic-plan: $(STAMP)
	$(PY) -m bench.elastic_plan

# the planner under tensor parallelism: Llama-3 8B / 70B / 405B, T in {1, 2, 4, 8} (minutes)
bench-tp-plan: $(STAMP)
	$(PY) -m bench.tp_plan

# the planner under expert parallelism: Qwen3-30B-A3B, Kimi K2 / DeepSeek-V3 shapes, P in
# {1, 8, 16, 32, 64} (about 4 minutes on 2 cores)
bench-ep-plan: $(STAMP)
	$(PY) -m bench.ep_plan

# expert parallelism measured: small-moe on 4 gloo ranks, EP 1 against EP 2 (a minute)
bench-ep-run: $(STAMP)
	$(PY) -m bench.ep_run

# the single-GPU check (world size 1, NCCL; estimated 5 minutes on one H200): NS error by
# precision and scale, the side-stream race, compile and CUDA graphs, memory_report, step
# time against FSDP2 + AdamW at 1B params. A machine without internet runs it with a
# Python that has torch: `make bench-gpu GPU_PYTHON=python3` (then nothing is installed)
bench-gpu: $(if $(GPU_PYTHON),,$(STAMP))
	$(or $(GPU_PYTHON),$(PY)) -m bench.gpu $(GPU_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check dmuon service tests bench

# bench/results keeps its dated records (tracked): only the untracked outputs go
clean:
	rm -rf $(VENV) .pytest_cache demo_runs
	git clean -qfX bench/results
