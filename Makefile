# Set-up on a fresh machine (Python 3.11 + pip) is part of every target.
# TORCH_SPEC pins the CPU build that lies on this project's machines; GPU users override it,
# e.g. `make test TORCH_SPEC="torch"` or point it at their CUDA wheel index.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
# the suite runs in two workers (most of a test is dynamo tracing, on one core); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck bench bench-throughput bench-blocks bench-cold bench-long clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fxoffload-hf demo

lint: $(STAMP)
	$(VENV)/bin/ruff check fxoffload_hf tests benchmarks examples
	$(VENV)/bin/ruff format --check fxoffload_hf tests benchmarks examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy fxoffload_hf

test: lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_cpu_offload.py

# a batch of 32 prompts against one by one, accelerate and eager (about 10 minutes); not part of bench
bench-throughput: $(STAMP)
	$(PY) benchmarks/bench_throughput.py

# Lightning predict over 64 batches in blocks of 1 and 8 batches, under a memory limit (about 5 minutes)
bench-blocks: $(STAMP)
	$(PY) benchmarks/bench_predict_blocks.py

# load + the first generate in fresh processes: eager, accelerate, fxoffload first-call and deferred (about 3 minutes)
bench-cold: $(STAMP)
	$(PY) benchmarks/bench_cold_start.py

# a KV cache that outgrows the budget: 1,000 new tokens under a memory limit, fxoffload and accelerate (about 10 minutes)
bench-long: $(STAMP)
	$(PY) benchmarks/bench_long_generation.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
