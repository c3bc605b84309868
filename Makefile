# The two commands of the README: `make run` and `make test`.
# Each creates .venv on first use and installs what it needs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# A CPU build of torch; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: run test venv clean

$(BIN)/activate:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml $(BIN)/activate
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[engine,test]"
	touch $@

venv: $(VENV)/.installed

run: venv
	$(BIN)/firsttoken serve $(ARGS)

test: venv
	$(BIN)/python -m pytest $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
