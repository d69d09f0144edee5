# moetrain developer commands. `make train` and `make test` install what they need first.
# Python >= 3.12 (jax >= 0.11 needs it): the first of python3.12, python3.13 or a pyenv 3.12+ that runs.
PY ?= $(shell for p in python3.12 python3.13 $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3; do \
  $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo $$p; break; }; done)
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/longcat_lora.py
# The container image (Dockerfile) for GKE and xpk: python -m moetrain.tools.launch --image=...
IMAGE ?= moetrain:latest
export XLA_PYTHON_CLIENT_PREALLOCATE ?= false
# Huge-page malloc for XLA:CPU's per-call temporaries (see moetrain/core/runtime.py); the entry points
# set it themselves by re-executing, this spares them that and covers pytest.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: install train test test-slow lint format bench image clean

# The stamp names the interpreter line, so a venv made by an older Python is made anew.
STAMP := $(VENV)/.installed-py312

$(STAMP): pyproject.toml
	@test -n "$(PY)" || { echo 'make: no Python >= 3.12 found (set PY=/path/to/python3.12)'; exit 1; }
	@$(VENV)/bin/python -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || \
	  { rm -rf $(VENV); $(PY) -m venv $(VENV) && $(BIN)/pip install -q --upgrade pip; }
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

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

image:
	docker build -t $(IMAGE) .

clean:
	rm -rf runs .pytest_cache
