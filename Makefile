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

DATA   ?=
ARGS   ?=
# pretraining: BATCH=<8k|16k|32k|64k|demo> OPT=<lamb|onebit_lamb|adamw|onebit_adam> MODEL=... NPROC=...
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
# SLOW=0 leaves out tests marked slow (CI runs them: SLOW=1 is the default).
SLOW   ?= 1
PYTEST_MARK := $(if $(filter 0,$(SLOW)),-m "not slow",)

.PHONY: help setup demo test lint prepare pretrain finetune compare bench clean-prepared

help:
	@echo "make demo      whole pipeline at tiny scale on ../shared/data (creates .venv)"
	@echo "make test      all tests (SLOW=0 skips the slow tier)"
	@echo "make prepare   DATA=<sample|tiny|wikipedia_bookcorpus> ARGS='hydra overrides'"
	@echo "make pretrain  BATCH=<demo|8k|16k|32k|64k> OPT=<lamb|onebit_lamb|adamw|onebit_adam> MODEL=... NPROC=..."
	@echo "make finetune  TASK=<squad|mrpc|...|glue> CKPT=<run folder or HF folder> FT_NPROC=... ARGS=..."
	@echo "make bench     benchmarks -> results/bench/*.json"
	@echo "make lint      ruff + mypy"

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q $(PIP_C) "$(TORCH)",)
	$(PY) -m pip install -q $(PIP_C) -e ".[dev]"
	@touch $(STAMP)

demo: setup data/prepared/tiny/seq128/manifest.json
	$(MAKE) --no-print-directory pretrain BATCH=demo OPT=lamb ARGS="run_name=demo-lamb $(ARGS)"
	$(MAKE) --no-print-directory pretrain BATCH=demo OPT=onebit_lamb ARGS="run_name=demo-onebit_lamb $(ARGS)"
	@echo "demo: runs in results/runs/demo-lamb and results/runs/demo-onebit_lamb (metrics.jsonl, checkpoints/*/hf)"

test: setup
	$(PY) -m pytest $(PYTEST_MARK) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

prepare: setup
	$(PY) -m data.prepare data=$(or $(DATA),sample) $(ARGS)

data/prepared/%/seq128/manifest.json: | setup
	$(PY) -m data.prepare data=$* show_progress=false

# torchrun on this node; multi-node and SLURM: see launch/README.md
pretrain: setup data/prepared/$(PRETRAIN_DATA)/seq128/manifest.json
	launch/torchrun.sh $(if $(NPROC),--nproc $(NPROC),) -- batch=$(BATCH) optim=$(OPT) model=$(MODEL) \
	  data_dir=data/prepared/$(PRETRAIN_DATA) $(ARGS)

# fine-tuning: TASK=<squad|cola|sst2|mrpc|stsb|qqp|mnli|qnli|rte|wnli|glue> CKPT=<pretraining run folder
# (its newest complete checkpoint's hf/) or any HF BERT folder>; FT_NPROC=N: torchrun data parallel.
# TASK=glue is a Hydra multirun over GLUE_TASKS, one task after another.
TASK       ?= mrpc
CKPT       ?=
FT_NPROC   ?=
GLUE_TASKS ?= cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte,wnli
finetune: setup
	@test -n "$(CKPT)" || { echo "make finetune: set CKPT=<pretraining run folder or HF BERT folder>" >&2; exit 2; }
	$(if $(FT_NPROC),$(VENV)/bin/torchrun --standalone --nproc-per-node $(FT_NPROC),$(PY)) -m finetune \
	  $(if $(filter glue,$(TASK)),-m task=$(GLUE_TASKS),task=$(TASK)) model_path=$(CKPT) $(ARGS)

compare: setup
	@$(PY) -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('results.compare') else 'make compare: the comparison step is not in this version yet (issue #6)')"
	$(PY) -m results.compare $(ARGS)

bench: setup
	$(PY) -m bench $(ARGS)

clean-prepared:
	rm -rf data/prepared
