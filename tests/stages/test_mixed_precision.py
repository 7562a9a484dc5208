"""Mixed-precision training (float32 weights, ``activations_dtype=bfloat16``) for every family's
denoiser: the compiled gradient runs (XLA CPU has failed at run time on bf16 products whose
operands were rearranged after it chose not to upcast them: ``Unsupported element type for
DotThunk``; the products fed by ``jaxcore.kernels.products.transposed_copy``, the Dense
weight gradient's and the bf16 attention dq's, are such products) and tracks the float32 gradient of the same parameters on the same batch.

Tolerances: bf16 keeps 8 bits of mantissa (relative rounding 2^-9) and every product sums in
float32, so the loss agrees to ~1e-2 and the whole gradient, as one vector, to a few percent
(measured: Wan 0.63%, Flux 0.53%, SD 1.7%); a gradient computed from wrong operands is O(1) off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore.compute import ComputeConfig
from jaxcore.families import TensorSpec
from jaxcore.sharding import MeshConfig, make_mesh
from stages.common import objective
from stages.common.objective import ObjectiveSection
from stages.train import model
from stages.train.config import ModelSection
from tests.support import train_steps
from tests.support.tiny_flux import build_flux_pipeline
from tests.support.tiny_sd import build_sd_pipeline
from tests.support.wan_variants import write_one_layer_wan_yaml

FEATURES = {
    "wan": (TensorSpec("latents", (4, 1, 8, 8)), TensorSpec("encoder_hidden_states", (8, 32))),
    "flux": (
        TensorSpec("latents", (4, 8, 8)),
        TensorSpec("encoder_hidden_states", (8, 32)),
        TensorSpec("pooled_projections", (24,)),
    ),
    "sd": (TensorSpec("latents", (4, 8, 8)), TensorSpec("encoder_hidden_states", (20, 32))),
}


@pytest.fixture(scope="module")
def sections(tmp_path_factory) -> dict[str, tuple[ModelSection, object]]:
    """(model section, pipeline directory for the noise schedule) per family."""
    root = tmp_path_factory.mktemp("models")
    (root / "wan").mkdir()
    flux = build_flux_pipeline(root / "flux", seed=5, guidance_embeds=False)
    sd = build_sd_pipeline(root / "sd", seed=1)
    return {
        "wan": (ModelSection(model_config=write_one_layer_wan_yaml(root / "wan")), None),
        "flux": (ModelSection(pretrained_model_name_or_path=str(flux)), flux),
        "sd": (ModelSection(pretrained_model_name_or_path=str(sd)), sd),
    }


def _loss_and_gradient(section, pipeline_dir, batch, compute):
    mesh = make_mesh(MeshConfig(), devices=jax.devices()[:1])
    built = model.build_model(section, compute, mesh, jax.random.key(0))
    cfg = ObjectiveSection()
    target = objective.training_target(built.family, cfg, pipeline_dir)

    def loss(params):
        return objective.training_loss(
            built.family, built.module, params, batch, jax.random.key(7), cfg, None, target
        )

    value, grads = jax.jit(jax.value_and_grad(loss))(built.params)
    return float(value), np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_mixed_precision_gradient_tracks_float32(sections, name):
    section, pipeline_dir = sections[name]
    batch = {k: jnp.asarray(v) for k, v in train_steps.random_batch(FEATURES[name], rows=2).items()}
    loss_32, grad_32 = _loss_and_gradient(section, pipeline_dir, batch, ComputeConfig())
    loss_16, grad_16 = _loss_and_gradient(
        section, pipeline_dir, batch, ComputeConfig(activations_dtype="bfloat16")
    )
    assert grad_16.dtype == np.float32 and np.all(np.isfinite(grad_16))
    assert loss_16 == pytest.approx(loss_32, rel=1e-2)
    relative = np.linalg.norm(grad_16 - grad_32) / np.linalg.norm(grad_32)
    assert relative < 0.05, relative
