# difforge: the commands the README gives. Each target creates .venv on first use, with Python
# 3.12 (infra/find-python finds one: python3.12 on the PATH or pyenv's; PYTHON=... overrides).
PYTHON ?=
VENV := .venv
# The jax every test and benchmark here runs on. Not 0.12.1: its jaxlib runs XLA CPU's bf16
# products ~5x slower (bf16 in / f32 out, 2048^2: 280 against 1,526-1,596 GFLOP/s on this 2-core
# AMX host; 0.12.0 and 0.11.2 run them at ~1,500), and its tpu extra pins a libtpu (0.0.53)
# the package index does not have; 0.12.0.1 pins 0.0.50, which it has.
JAX_VERSION := 0.12.0.1
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL ?= 2
export NO_GCE_CHECK ?= true

.PHONY: install demo test test-slow test-faults test-all lint format bench clean xpk-venv tpu-libs maxdiffusion-venv

$(STAMP): setup.py
	@# a .venv from before the move to Python 3.12 (jax 0.10 on 3.11) cannot hold jax 0.12
	@if ! $(PY) -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then \
	  py="$(PYTHON)"; [ -n "$$py" ] || py=$$(infra/find-python) || exit 1; \
	  echo "creating $(VENV) with $$py"; rm -rf $(VENV); "$$py" -m venv $(VENV) || exit 1; fi
	$(PY) -m pip install -q -U pip
	# torch first, pinned: it is only a test oracle. PyPI's torch for Python 3.12 is the CUDA
	# build (~4.6 GiB with its nvidia-* wheels, ~1 min to download here); it runs on the CPU.
	# jax pinned to the tested release (setup.py accepts any 0.12.x; see JAX_VERSION).
	$(PY) -m pip install -q torch==2.13.0 jax==$(JAX_VERSION) jaxlib==$(JAX_VERSION)
	$(PY) -m pip install -q -e ".[test]"
	$(VENV)/bin/difforge prepare
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/difforge prepare > /dev/null
	$(VENV)/bin/difforge demo root=outputs/demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not faults"

# faults injected into every stage, and fuzzed bad input: prints the counts (~20 min)
test-faults: $(STAMP)
	$(PY) -m pytest -q -s -m faults tests/faults

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(VENV)/bin/difforge prepare > /dev/null
	$(PY) -m bench.run
	$(PY) -m bench.readme --write  # docs/benchmarks.md quotes the run just made

clean:
	rm -rf $(VENV) outputs build *.egg-info

# libtpu for the TPU fit check (jaxcore/aot.py) on a machine without TPUs: outside the import
# path (on the path, every `import jax` would probe for TPU chips); jaxcore.aot finds it there.
# The release jax's tpu extra pins (0.0.50 for JAX_VERSION); where the index does not have it
# (jax 0.12.1 pins 0.0.53, the index here ends at 0.0.52), the newest before it, said on stderr.
tpu-libs: $(STAMP)
	pin=$$($(PY) -c 'from jaxcore.aot import libtpu_pin; print(libtpu_pin())') && \
	( $(PY) -m pip install -q -U --no-deps --target $(VENV)/tpu-libs "libtpu==$$pin.*" 2>/dev/null || \
	  ( echo "libtpu $$pin (jax's tpu extra pin) is not on the index; installing the newest before it" >&2 && \
	    $(PY) -m pip install -q -U --no-deps --target $(VENV)/tpu-libs "libtpu<$$pin" ) )

# xpk pins its own dependencies, so it lives in its own venv (used by `difforge deploy target=xpk`).
xpk-venv:
	test -x .venv-xpk/bin/xpk || (py="$(PYTHON)"; [ -n "$$py" ] || py=$$(infra/find-python) && \
		"$$py" -m venv .venv-xpk && .venv-xpk/bin/pip install -q xpk==1.16.0)

# MaxDiffusion, the JAX peer bench/vs_maxdiffusion.py times and bench/tpu_compile.py compiles
# (bench/maxdiffusion_tpu.py): not on PyPI and Python >= 3.12, so a venv of its own;
# MAXDIFFUSION_SRC is the src folder of a maxdiffusion checkout. These are the packages the
# imports of its Wan and Flux transformers, pyconfig, max_utils, wan_pipeline, generate_flux
# and trainers/flux_trainer need (checked at maxdiffusion 7cfb880): torch (wan_utils),
# tensorflow / grain / datasets (its input pipeline, imported by the Flux trainer and
# generate_flux), transformers < 5 (its Flax CLIP / T5), with the hub client and datasets pinned
# to what that transformers takes. jax and flax pinned to ours: one compiler on both sides.
maxdiffusion-venv: $(STAMP)
	test -n "$(MAXDIFFUSION_SRC)" || (echo "set MAXDIFFUSION_SRC=<maxdiffusion checkout>/src" >&2; exit 2)
	test -x .venv-maxdiffusion/bin/python || $(PY) -m venv .venv-maxdiffusion
	.venv-maxdiffusion/bin/pip install -q "jax==$$($(PY) -c 'import jax; print(jax.__version__)')" \
		"flax==$$($(PY) -c 'import flax; print(flax.__version__)')" \
		einops packaging pillow requests tensorboardX google-cloud-storage aqtp chex torch \
		safetensors tensorflow qwix grain "transformers<5" "huggingface_hub<1.0" "datasets<4" \
		jaxopt scikit-image
	@echo "then: DIFFORGE_MAXDIFFUSION_PYTHON=$(CURDIR)/.venv-maxdiffusion/bin/python" \
		"DIFFORGE_MAXDIFFUSION_SRC=$(MAXDIFFUSION_SRC) make bench"
