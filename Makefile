# The project's interface. Every target that needs Python depends on `setup`, so a fresh clone
# needs no other step. Make variables map to Hydra overrides; ARGS="..." passes any other override.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV        ?= .venv
PY          := $(VENV)/bin/python
# CPU machines pin the CPU build of torch (on local disk here); GPU users: `make setup TORCH= CONSTRAINTS=`
# after installing their CUDA build of torch into $(VENV) (see README).
TORCH       ?= torch==2.13.0
CONSTRAINTS ?= constraints.txt
PIP_C       := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
STAMP       := $(VENV)/.setup-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
DOCS_STAMP  := $(VENV)/.docs-stamp
comma       := ,

DATA   ?=
ARGS   ?=
# pretraining: BATCH=<8k|16k|32k|64k|demo> OPT=<lamb|onebit_lamb|onebit_lamb_deepspeed|adamw|onebit_adam> MODEL=... NPROC=...
BATCH  ?= demo
OPT    ?= lamb
ifeq ($(BATCH),demo)
MODEL  ?= bert_tiny
NPROC  ?= 2
PRETRAIN_DATA := $(or $(DATA),tiny)
else
MODEL  ?= bert_large
NPROC  ?=
# empty NPROC: launch/torchrun.sh starts one process per visible GPU
PRETRAIN_DATA := $(or $(DATA),wikipedia_bookcorpus)
endif
PYTEST_ARGS ?=
# Test tiers (pytest marker `slow`, pyproject.toml). `make test`: the fast tier, to run after every change: every
# package at the unit level and one quick run of each multi-process and end-to-end flow (994 of 1128 tests). On a
# fresh clone, 2 otherwise idle cores: 454 s with the venv and cold numba/compile caches, 285 s warm
# (docs/testing.md). `make test-all` (= `make test SLOW=1`; CI: .ci/run): the slow tier too.
SLOW   ?= 0
PYTEST_MARK := $(if $(filter 0,$(SLOW)),-m "not slow",)

.PHONY: help setup demo test test-all test-gpu gpu-check lint prepare preflight pretrain finetune compare dashboard bench bench-net reliability chaos docs clean-prepared

help:
	@echo "make demo      whole pipeline at tiny scale on ../shared/data (creates .venv)"
	@echo "make test      the fast tier, after every change (fresh clone, 2 cores: 7.6 min, 4.8 warm; SLOW=1: as make test-all)"
	@echo "make test-all  every test, the slow tier included (what CI runs)"
	@echo "make prepare   DATA=<sample|tiny|wikipedia_bookcorpus> ARGS='hydra overrides'"
	@echo "make pretrain  BATCH=<demo|8k|16k|32k|64k> OPT=<lamb|onebit_lamb|onebit_lamb_deepspeed|adamw|onebit_adam> MODEL=... NPROC=..."
	@echo "make preflight BATCH=... OPT=... MODEL=... NPROC=<world size>: what make pretrain would do, and whether it can"
	@echo "make finetune  TASK=<squad|mrpc|...|glue> [CKPT=<run folder or HF folder>: default the latest run] FT_NPROC=... ARGS=..."
	@echo "make compare   STUDY=<name> RUNS='results/runs/a results/runs/b*' -> results/<name>/report.md"
	@echo "make dashboard W&B workspace spec (ARGS='save=true entity=<team>' creates it)"
	@echo "make bench     benchmarks -> results/bench/*.json"
	@echo "make bench-net emulated-Ethernet benchmark (root) + scaling model -> results/bench/net*.json, results/scaling/"
	@echo "make reliability  kill -9/resume, bad-input and security suite -> results/reliability.md"
	@echo "make chaos     SEED=<n> FAULTS=<n> CHAOS_OPT=<onebit_lamb|lamb>: random faults through one run (minutes)"
	@echo "make gpu-check one CUDA GPU, ~8 min: packers, allreduce, test-gpu + pipeline, optimizer steps, MFU, step arms -> results/bench/gpu.json (ARGS=--cpu-smoke: on the CPU)"
	@echo "make test-gpu  tests marked gpu; NPROC=N (>= 2 GPUs): the compressed allreduce and demo pretraining over NCCL"
	@echo "make lint      ruff + mypy"
	@echo "make docs      the documentation site (mkdocs build --strict) -> site/"

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q $(PIP_C) "$(TORCH)",)
	$(PY) -m pip install -q $(PIP_C) -e ".[dev]"
	@touch $(STAMP)

# The demo: prepare -> pretrain (LAMB, 1-bit LAMB; 2 CPU processes, both phases, crossing freeze_step) ->
# fine-tune both on MRPC and a SQuAD slice -> comparison report in results/demo/ (git-ignored). With no local sample data
# (no $$BERT_SHARED_DATA, no ../shared/data) it prepares a small slice of the hub datasets and fine-tunes on the
# hub's GLUE/SQuAD instead. DEMO_FT_ARGS: extra fine-tuning overrides (CI's smoke variant caps the data further).
SHARED_DATA  := $(or $(BERT_SHARED_DATA),$(abspath ../shared/data))
DEMO_DATA    := $(if $(wildcard $(SHARED_DATA)/vocab),tiny,hub_tiny)
DEMO_FT_DATA := $(if $(filter hub_tiny,$(DEMO_DATA)),data_dir=null,)
DEMO_RUNS    := demo-lamb demo-onebit_lamb
# Where the demo writes: run folders and the report (tests point these at a temporary folder).
DEMO_RUNS_DIR ?= results/runs
DEMO_REPORT   ?= results/demo
DEMO_FT_ARGS  ?=
DEMO_FT_COMMON = task.lr=1e-4 seeds=[1] show_progress=false wandb.mode=offline $(DEMO_FT_DATA) $(DEMO_FT_ARGS)
demo: setup data/prepared/$(DEMO_DATA)/seq128/manifest.json
	@for run in $(DEMO_RUNS); do \
	  $(MAKE) --no-print-directory pretrain BATCH=demo OPT=$${run#demo-} DATA=$(DEMO_DATA) \
	    ARGS="run_name=$$run run_dir=$(DEMO_RUNS_DIR)/$$run show_progress=false wandb.mode=offline $(ARGS)" || exit $$?; \
	done
	@for run in $(DEMO_RUNS); do \
	  out=$(DEMO_RUNS_DIR)/$$run/finetune/final; \
	  set -x; \
	  $(PY) -m finetune task=mrpc model_path=$(DEMO_RUNS_DIR)/$$run output_dir=$$out/mrpc $(DEMO_FT_COMMON) || exit $$?; \
	  $(PY) -m finetune task=squad model_path=$(DEMO_RUNS_DIR)/$$run output_dir=$$out/squad task.epochs=1 \
	    task.max_length=192 task.doc_stride=64 task.max_train_examples=600 task.max_eval_examples=300 \
	    $(DEMO_FT_COMMON) || exit $$?; \
	  set +x; \
	done
	$(PY) -m results.compare study=demo output_dir=$(abspath $(DEMO_REPORT)) \
	  'runs=[$(subst $(eval) ,$(comma),$(addprefix $(abspath $(DEMO_RUNS_DIR))/,$(DEMO_RUNS)))]'
	@echo "demo: pretraining runs in $(DEMO_RUNS_DIR)/{$(subst $(eval) ,$(comma),$(DEMO_RUNS))} (fine-tunes in */finetune/final/)"
	@echo "demo: comparison report in $(DEMO_REPORT)/report.md"

test: setup
	$(PY) -m pytest $(PYTEST_MARK) $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# GPU machines (docs/gpus.md): what only a GPU can check (bench/gpu/; on a lent machine bench/gpu/device.sh).
# Without CUDA gpu-check says so and exits 0 (ARGS=--cpu-smoke runs it at toy sizes on the CPU),
# and test-gpu's tests skip with the reason.
gpu-check: setup
	$(PY) -m bench gpu $(ARGS)

test-gpu: setup
	GPU_TEST_NPROC=$(NPROC) $(PY) -m pytest -m gpu -rs $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

prepare: setup
	$(PY) -m data.prepare data=$(or $(DATA),sample) $(ARGS)

data/prepared/%/seq128/manifest.json: | setup
	$(PY) -m data.prepare data=$* show_progress=false

# torchrun on this node; multi-node and SLURM: see launch/README.md
# the pre-flight report (pretrain/tools/preflight.py): what `make pretrain` with the same variables would do, and
# whether it can; NPROC = the world size to check (e.g. 64 for 8 nodes of 8 GPUs)
preflight: setup
	$(PY) -m pretrain.tools.preflight batch=$(BATCH) optim=$(OPT) model=$(MODEL) data_dir=data/prepared/$(PRETRAIN_DATA) \
	  $(if $(NPROC),dry_run_world_size=$(NPROC),) $(ARGS)

pretrain: setup data/prepared/$(PRETRAIN_DATA)/seq128/manifest.json
	launch/torchrun.sh $(if $(NPROC),--nproc $(NPROC),) -- batch=$(BATCH) optim=$(OPT) model=$(MODEL) \
	  data_dir=data/prepared/$(PRETRAIN_DATA) $(ARGS)

# fine-tuning: TASK=<squad|cola|sst2|mrpc|stsb|qqp|mnli|qnli|rte|wnli|glue> CKPT=<pretraining run folder
# (its newest complete checkpoint's hf/) or any HF BERT folder>; without CKPT the run under FT_RUNS_DIR whose
# newest checkpoint was completed last (finetune/latest.py); FT_NPROC=N: torchrun data parallel.
# TASK=glue is a Hydra multirun over GLUE_TASKS, one task after another.
TASK       ?= mrpc
CKPT       ?=
FT_NPROC   ?=
FT_RUNS_DIR ?= results/runs
GLUE_TASKS ?= cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte,wnli
finetune: setup
	@ckpt="$(CKPT)"; if [ -z "$$ckpt" ]; then ckpt=$$($(PY) -m finetune.latest $(FT_RUNS_DIR)) || exit $$?; fi; \
	set -x; $(if $(FT_NPROC),$(VENV)/bin/torchrun --standalone --nproc-per-node $(FT_NPROC),$(PY)) -m finetune \
	  $(if $(filter glue,$(TASK)),-m task=$(GLUE_TASKS),task=$(TASK)) model_path="$$ckpt" $(ARGS)

# comparison report: STUDY=<name> (-> results/<name>/) RUNS="<run folders or globs, space-separated>"
STUDY ?=
RUNS  ?=
compare: setup
	@test -n "$(STUDY)" || { echo "make compare: set STUDY=<name> (the report goes to results/<name>/)" >&2; exit 2; }
	$(PY) -m results.compare study=$(STUDY) $(if $(strip $(RUNS)),'runs=[$(subst $(eval) ,$(comma),$(strip $(RUNS)))]',) $(ARGS)

# W&B workspace with the comparison's panels: offline it builds the spec; ARGS="save=true entity=<team>" creates it
dashboard: setup
	$(PY) -m results.compare.dashboard $(ARGS)

# the bench extra (torch-optimizer: the records that race torch_optimizer.Lamb), installed once
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q $(PIP_C) -e ".[dev,bench]"
	@touch $@

bench: $(BENCH_STAMP)
	$(PY) -m bench $(ARGS)

# the docs extra (mkdocs, mkdocs-material), installed once; figures come from results/bench/*.json (docs/hooks.py)
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q $(PIP_C) -e ".[dev,docs]"
	@touch $@

docs: $(DOCS_STAMP)
	$(VENV)/bin/mkdocs build --strict

# needs root (network namespaces, veth, tc); ARGS=--quick for the seconds-long variant (*_quick.json,
# no scaling report). launch/netns.sh cleanup removes what a killed run left.
bench-net: setup
	$(PY) -m bench net $(ARGS)
	$(if $(filter --quick,$(ARGS)),,$(PY) -m bench net --part=e2e --compile)
	$(if $(filter --quick,$(ARGS)),,$(PY) -m bench net --part=e2e --no-keep-host-memory)
	$(if $(filter --quick,$(ARGS)),,$(PY) -m bench scaling)

# tests/reliability with 10 kill points (CI's `make test-all` runs them with 3); ARGS=--ci for CI's subset
reliability: setup
	$(PY) -m tests.reliability.report $(ARGS)

# the chaos soak (tests/chaos/): FAULTS random faults (seeded by SEED) through one 2-rank run of the demo
# recipe, relaunched by launch/supervise.py; the end state must equal an uninterrupted run's bit for bit.
# -> results/chaos/seed<SEED>-<CHAOS_OPT>-<FAULTS>.json and the chaos table of results/reliability.md.
# Root adds the disk (tmpfs) and link (network namespaces) faults; without it they are skipped, saying so.
SEED      ?= 1
FAULTS    ?= 50
CHAOS_OPT ?= onebit_lamb
chaos: setup
	$(PY) -m tests.chaos --seed $(SEED) --faults $(FAULTS) --optim $(CHAOS_OPT) $(ARGS)

clean-prepared:
	rm -rf data/prepared
