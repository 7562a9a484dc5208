"""LTX-2 quantized (``compute.quantization``): the audio-video transformer's kernels held in
int8 / float8 (and, in ``int8`` / ``fp8``, its products run quantized) through the one seam
every family uses (:mod:`jaxcore.quantization`, :mod:`jaxcore.models.layers`).

A tiny random-init ``LTX2Pipeline`` (tests/support/tiny_ltx2.py), rendered from the same video
and audio latents with CFG and the family's default modality guidance: each modality of the
quantized render stays within :data:`RENDER_TOLERANCE` (relative L2 of what the float render
changed) of the float one, the kernels take under half the bytes, and the product-quantized
modes differ from their weights-only twins (so the products did run quantized).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcore import quantization
from jaxcore.compute import ComputeConfig
from jaxcore.families import load_pipeline, ltx2
from tests.support import tiny_ltx2

# the same bounds as tests/jaxcore/test_quantization.py's renders of the other families
RENDER_TOLERANCE = {"int8_weights": 0.05, "fp8_weights": 0.2, "int8": 0.05, "fp8": 0.2}
HEIGHT = WIDTH = 32
NUM_FRAMES = 9
STEPS = 3
MAX_SEQUENCE_LENGTH = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_ltx2.build_ltx2_pipeline(tmp_path_factory.mktemp("ltx2_quantized"), seed=2)


@pytest.fixture(scope="module")
def float_render(model_dir):
    pipe = load_pipeline(model_dir)
    return pipe, _render(pipe)


def _render(pipe):
    """(initial latents, rendered latents) ``[1, C + K, F', H', W']`` of one prompt."""
    shape = pipe.latent_shape(HEIGHT, WIDTH, NUM_FRAMES)
    latents = pipe.family.initial_latents(pipe.configs, shape, 3, {})[None]
    settings = {"modality_scale": 3.0, "seed": 3}
    row = pipe.guidance(3.0, settings=settings)
    cond, uncond, scales = pipe.conditioning(
        ["a red fox in the snow"],
        [""],
        [row],
        MAX_SEQUENCE_LENGTH,
        size=(HEIGHT, WIDTH, NUM_FRAMES),
        micro_conditioning=[settings],
    )
    out = pipe.sample(latents, cond, uncond, num_inference_steps=STEPS, cfg_scale=scales)
    return latents, np.asarray(out)


def _relative_change(pipe, latents, got, want) -> dict[str, float]:
    """Per modality: |got - want| / |want - initial| (L2)."""
    joint = ltx2.layout(pipe.configs, latents.shape[2:])
    parts = [ltx2.split_latents(np.asarray(x), joint) for x in (latents, got, want)]
    out = {}
    for index, name in enumerate(("video", "audio")):
        start, quantized, reference = (p[index] for p in parts)
        out[name] = float(np.linalg.norm(quantized - reference) / np.linalg.norm(reference - start))
    return out


@pytest.mark.parametrize(
    "mode", ["int8", pytest.param("fp8", marks=pytest.mark.slow), "int8_weights", "fp8_weights"]
)
def test_a_quantized_ltx2_render_is_close_to_the_float_one(model_dir, float_render, mode):
    float_pipe, (latents, reference) = float_render
    pipe = load_pipeline(model_dir, ComputeConfig(quantization=mode))
    assert quantization.is_quantized(pipe.denoiser_params)
    held, full = map(quantization.weight_bytes, (pipe.denoiser_params, float_pipe.denoiser_params))
    assert held < 0.5 * full
    _, quantized = _render(pipe)
    errors = _relative_change(pipe, latents, quantized, reference)
    print(f"{mode}: relative L2 video {errors['video']:.4f}, audio {errors['audio']:.4f}")
    for name, error in errors.items():
        assert 0 < error < RENDER_TOLERANCE[mode], (name, error)
    if quantization.quantizes_products(mode):
        weights_only = load_pipeline(model_dir, ComputeConfig(quantization=f"{mode}_weights"))
        assert not np.array_equal(_render(weights_only)[1], quantized)
