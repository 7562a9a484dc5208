"""The train step's CPU compiler options (``jaxcore.compute.CPU_TRAIN_STEP_OPTIONS``) change
how XLA:CPU emits the step, not what it computes: a step compiled with them equals the step
compiled without them (parameters after one AdamW step and the loss, 1e-6 on a one-layer Wan
DiT; only the order of float32 sums may differ). An option this XLA refuses falls back to the
default compilation instead of failing."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxcore import compute, sharding
from jaxcore.families import TensorSpec
from stages.train import trainer
from stages.train.config import ModelSection
from tests.support import train_steps
from tests.support.wan_variants import write_one_layer_wan_yaml

FEATURES = (TensorSpec("latents", (4, 1, 8, 8)), TensorSpec("encoder_hidden_states", (8, 32)))


def test_options_are_taken_here_and_refused_ones_fall_back():
    assert jax.default_backend() == "cpu"
    taken = compute.cpu_compiler_options(**compute.CPU_TRAIN_STEP_OPTIONS)
    assert taken == compute.CPU_TRAIN_STEP_OPTIONS
    assert compute.cpu_compiler_options(xla_cpu_no_such_option=True) is None
    assert compute.train_step_compiler_options("cpu") == compute.CPU_TRAIN_STEP_OPTIONS
    assert compute.train_step_compiler_options("tpu") == compute.TPU_TRAIN_STEP_OPTIONS
    assert compute.train_step_compiler_options("gpu") is None


def test_a_step_with_the_options_equals_one_without(tmp_path, monkeypatch):
    section = ModelSection(model_config=write_one_layer_wan_yaml(tmp_path))
    mesh = sharding.make_mesh(sharding.MeshConfig(), devices=jax.devices()[:1])
    host = train_steps.random_batch(FEATURES, rows=4, seed=3)
    with_options = train_steps.one_step(section, mesh, FEATURES, host, step=5)
    monkeypatch.setattr(trainer, "train_step_compiler_options", lambda platform: None)
    without = train_steps.one_step(section, mesh, FEATURES, host, step=5)
    assert with_options[1] == pytest.approx(without[1], abs=1e-6)
    worst = max(
        jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), with_options[0], without[0]))
    )
    assert worst < 1e-6, worst
