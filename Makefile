# Quickstart: `make serve` starts the service on 127.0.0.1:8470; `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
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

.PHONY: serve test install install-train bench clean gpu-check-bundle

# setuptools warns on every editable install that folders named like the
# package may shadow it; here they are the package's source, so it is noise.
EDITABLE = PYTHONWARNINGS='ignore:Editable installation'

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel
	$(EDITABLE) $(PY) -m pip install --quiet -e '.[test]'
	if [ -n "$(ENGINE_INDEX)" ]; then \
		$(PY) -m pip install --quiet --force-reinstall --no-deps --index-url "$(ENGINE_INDEX)" \
			"xllamacpp==$$($(PY) -c 'from importlib.metadata import version; print(version("xllamacpp"))')"; \
	fi
	touch $(STAMP)

# The train extra (torch, transformers, peft) for finetune jobs and their tests.
$(TRAIN_STAMP): $(STAMP)
	$(PY) -m pip install --quiet $(TORCH_SPEC)
	$(EDITABLE) $(PY) -m pip install --quiet -e '.[test,train]'
	touch $(TRAIN_STAMP)

install: $(STAMP)

install-train: $(TRAIN_STAMP)

serve: $(STAMP)
	$(VENV)/bin/gpuvisor serve $(ARGS)

test: $(TRAIN_STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
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
	rm -rf $(VENV) build *.egg-info
