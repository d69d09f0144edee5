# moetrain developer commands. `make train` and `make test` install what they need first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/longcat_lora.py
export XLA_PYTHON_CLIENT_PREALLOCATE ?= false
# Huge-page malloc for XLA:CPU's per-call temporaries (see moetrain/runtime.py); the entry points
# set it themselves by re-executing, this spares them that and covers pytest.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: install train test test-slow lint format bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

train: install
	$(BIN)/python -m moetrain.main --config=$(CONFIG) $(ARGS)

test: install
	$(BIN)/python -m pytest -q -n 2 --dist worksteal $(ARGS)

test-slow: install
	$(BIN)/python -m pytest -q -m slow $(ARGS)

lint: install
	$(BIN)/ruff check moetrain configs tests bench
	$(BIN)/ruff format --check moetrain configs tests bench

format: install
	$(BIN)/ruff format moetrain configs tests bench
	$(BIN)/ruff check --fix moetrain configs tests bench

bench: install
	$(BIN)/python -m bench.moe_layer
	$(BIN)/python -m bench.train_step --mode lora
	$(BIN)/python -m bench.qlora_memory

clean:
	rm -rf runs .pytest_cache
