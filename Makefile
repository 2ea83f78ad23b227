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

DATA   ?= sample
ARGS   ?=
PYTEST_ARGS ?=
# SLOW=0 leaves out tests marked slow (CI runs them: SLOW=1 is the default).
SLOW   ?= 1
PYTEST_MARK := $(if $(filter 0,$(SLOW)),-m "not slow",)

.PHONY: help setup demo test lint prepare pretrain finetune compare bench clean-prepared

help:
	@echo "make demo      whole pipeline at tiny scale on ../shared/data (creates .venv)"
	@echo "make test      all tests (SLOW=0 skips the slow tier)"
	@echo "make prepare   DATA=<sample|tiny|wikipedia_bookcorpus> ARGS='hydra overrides'"
	@echo "make bench     benchmarks -> results/bench/*.json"
	@echo "make lint      ruff + mypy"

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH),$(PY) -m pip install -q $(PIP_C) "$(TORCH)",)
	$(PY) -m pip install -q $(PIP_C) -e ".[dev]"
	@touch $(STAMP)

demo: setup
	$(PY) -m data.prepare data=$(DATA) $(ARGS)
	@echo "demo: prepared shards are in data/prepared/$(DATA)/ (pretraining and fine-tuning land with issues #4-#6)"

test: setup
	$(PY) -m pytest $(PYTEST_MARK) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

prepare: setup
	$(PY) -m data.prepare data=$(DATA) $(ARGS)

pretrain: setup
	@$(PY) -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('pretrain.__main__') else 'make pretrain: the pretraining trainer is not in this version yet (issue #4)')"
	$(PY) -m pretrain $(ARGS)

finetune: setup
	@$(PY) -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('finetune.__main__') else 'make finetune: fine-tuning is not in this version yet (issue #5)')"
	$(PY) -m finetune $(ARGS)

compare: setup
	@$(PY) -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('results.compare') else 'make compare: the comparison step is not in this version yet (issue #6)')"
	$(PY) -m results.compare $(ARGS)

bench: setup
	$(PY) -m bench $(ARGS)

clean-prepared:
	rm -rf data/prepared
