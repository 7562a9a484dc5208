# difforge: the commands the README gives. Each target creates .venv on first use.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export TF_CPP_MIN_LOG_LEVEL ?= 2
export NO_GCE_CHECK ?= true

.PHONY: install demo test test-slow test-all lint format bench clean xpk-venv tpu-libs maxdiffusion-venv

$(STAMP): setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	# torch first, pinned: it is only a test oracle, and an unpinned one pulls a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/difforge demo root=outputs/demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-all: $(STAMP)
	$(PY) -m pytest -q -m ""

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) -m bench.run

clean:
	rm -rf $(VENV) outputs build *.egg-info

# libtpu for the TPU fit check (jaxcore/aot.py) on a machine without TPUs: outside the import
# path (on the path, every `import jax` would probe for TPU chips); jaxcore.aot finds it there.
tpu-libs: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(VENV)/tpu-libs "libtpu==0.0.42.*"

# xpk pins its own dependencies, so it lives in its own venv (used by `difforge deploy target=xpk`).
xpk-venv:
	test -x .venv-xpk/bin/xpk || ($(PYTHON) -m venv .venv-xpk && .venv-xpk/bin/pip install -q xpk==1.16.0)

# MaxDiffusion, the JAX peer bench/vs_maxdiffusion.py times: not on PyPI and Python >= 3.12, so a
# venv of its own; MAXDIFFUSION_SRC is the src folder of a maxdiffusion checkout. These are the
# packages its Wan transformer's imports need (jax pinned to ours: one compiler on both sides).
PYTHON312 ?= python3.12
maxdiffusion-venv: $(STAMP)
	test -n "$(MAXDIFFUSION_SRC)" || (echo "set MAXDIFFUSION_SRC=<maxdiffusion checkout>/src" >&2; exit 2)
	test -x .venv-maxdiffusion/bin/python || $(PYTHON312) -m venv .venv-maxdiffusion
	.venv-maxdiffusion/bin/pip install -q "jax[cpu]==$$($(PY) -c 'import jax; print(jax.__version__)')" \
		flax packaging huggingface_hub pillow requests einops tensorboardX google-cloud-storage \
		aqtp chex torch
	@echo "then: DIFFORGE_MAXDIFFUSION_PYTHON=$(CURDIR)/.venv-maxdiffusion/bin/python" \
		"DIFFORGE_MAXDIFFUSION_SRC=$(MAXDIFFUSION_SRC) make bench"
