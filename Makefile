# The two commands of the README: `make run` and `make test`; `make lint` is the quality gate
# that CI runs before the tests. Each creates .venv on first use and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Pinned: an unpinned torch would pull a multi-GB CUDA build. The pin resolves to a CPU wheel
# where pip is configured with one (as on this project's CI machines); elsewhere on Linux, add
# TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" for the CPU build.
TORCH_PIN ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: run test test-clients lint format venv clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml $(BIN)/activate
	$(BIN)/pip install -q "$(TORCH_PIN)" $(TORCH_INDEX)
	$(BIN)/pip install -q -e ".[engine,test,lint]"
	touch $@

venv: $(VENV)/.installed

run: venv
	$(BIN)/firsttoken serve $(ARGS)

test: venv
	$(BIN)/python -m pytest $(ARGS)

# The doors and translation tests again, in a venv of their own with the structured-output client
# libraries installed, so that their tests run (they skip in `make test`): instructor caps jiter
# below 0.15, which holds openai at 3.3.0 there, and dspy brings litellm, neither of which the
# suite's venv should carry; so these also run the doors against an older SDK than the main
# suite's newest. CI runs it after `make test`.
CLIENTS_VENV := .venv-clients

$(CLIENTS_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install -q --upgrade pip
	$(CLIENTS_VENV)/bin/pip install -q -e ".[test]" instructor dspy
	touch $@

test-clients: $(CLIENTS_VENV)/.installed
	$(CLIENTS_VENV)/bin/python -m pytest tests/doors tests/translation $(ARGS)

# Zero findings is the bar; every ignore carries a comment that says why.
lint: venv
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# Rewrites files: what `ruff format --check` and the fixable part of `ruff check` want.
format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .pytest_cache
