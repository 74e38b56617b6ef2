# Fresh-machine entry points (README): `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2

.PHONY: install run test lint slurm

$(BIN)/mixquant: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: on CPU machines this takes the local CPU build, not a multi-GB CUDA one.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

install: $(BIN)/mixquant

run: install
	$(BIN)/snakemake --cores $(CORES)
	$(BIN)/mixquant paths

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/snakefmt --check .
	$(BIN)/snakemake --lint --cores 1

# Debian's SLURM and munge, for the local-cluster test (tools/slurm-local; needs root or sudo).
slurm:
	bash tools/slurm-local/install.sh

test: lint slurm
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest
