"""The Flux family with ControlNets vs diffusers ``FluxControlNetPipeline`` on tiny pipelines.

The pipelines are built with diffusers (every weight perturbed, tests/support/tiny_flux.py) and
saved with ``save_pretrained``; both render the same prompts from the same initial latents.
Each batch here mixes per-row settings (scales, windows, modes, images); diffusers takes one
setting per call, so it renders row by row. Asserted: max |diff| <= 1e-4 on [0, 1] pixels;
reached 3.0e-6 (plain), 2.7e-6 (true CFG), 3.6e-6 (union modes), 3.2e-6 (union, two
conditions), 2.6e-6 (two ControlNets), 7.2e-6 (input_hint_block).

diffusers VAE-encodes the control image with ``retrieve_latents(..., generator)``, a *sample*
of the posterior, where difforge takes its mean: the tiny VAE's log-variance bias is set to -60
(clamped to -30, std ~3e-7) so that the two agree (``_tight_posterior`` in tiny_flux.py).
diffusers' image processor keeps a single-channel ("L") control image single-channel, which its
VAE refuses (a RuntimeError: 1 channel for 3); difforge converts it to RGB, and diffusers is
given the converted image.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcore import control
from jaxcore.families import FamilyError, load_pipeline
from jaxcore.models import flux_transformer
from jaxcore.sampling import initial_latents
from tests.support.tiny_flux import (
    build_flux_controlnet_pipeline,
    load_diffusers_controlnet_pipeline,
)

TOLERANCE = 1e-4
PROMPTS = ["a red circle on a white background", "blue square"]
NEGATIVE = ["dark background", "green"]
HEIGHT, WIDTH, STEPS, LENGTH = 16, 16, 3, 32


def _image(seed: int, size: tuple[int, int], mode: str = "RGB"):
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "L": 1}[mode]
    pixels = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    folder = build_flux_controlnet_pipeline(tmp_path_factory.mktemp("flux_cn"), seed=1)
    return load_pipeline(folder), load_diffusers_controlnet_pipeline(folder)


@pytest.fixture(scope="module")
def union_dir(tmp_path_factory):
    return build_flux_controlnet_pipeline(tmp_path_factory.mktemp("flux_cn_u"), union=True, seed=2)


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    folder = build_flux_controlnet_pipeline(tmp_path_factory.mktemp("flux_cn_m"), count=2, seed=3)
    return load_pipeline(folder), load_diffusers_controlnet_pipeline(folder)


def _diffusers_kwargs(given: control.ControlInput, multi: bool) -> dict:
    """One row's ControlInput as diffusers' call arguments (lists for a multi ControlNet)."""
    images = [im.convert("RGB") for im in given.images]
    modes = list(given.modes) or [None] * len(images)
    pick = (lambda v: list(v)) if multi else (lambda v: v[0])
    return {
        "control_image": pick(images),
        "controlnet_conditioning_scale": pick(given.scales),
        "control_guidance_start": pick(given.starts),
        "control_guidance_end": pick(given.ends),
        "control_mode": pick(modes),
    }


def _render(pipes, controls, *, multi=False, true_cfg=1.0, negative=None, batched_cfg=True):
    """(ours [B, H, W, 3], diffusers' row by row [B, H, W, 3]) from the same latents."""
    import torch

    ours_pipe, torch_pipe = pipes
    shape = ours_pipe.latent_shape(HEIGHT, WIDTH, 1)
    latents = np.stack([initial_latents(seed, shape) for seed in (3, 4)])
    guidances = [ours_pipe.guidance(3.5, true_cfg)] * len(PROMPTS)
    negatives = negative or [""] * len(PROMPTS)
    cond, uncond, scales = ours_pipe.conditioning(
        PROMPTS, negatives, guidances, LENGTH, size=(HEIGHT, WIDTH, 1), controls=controls
    )
    z = ours_pipe.sample(
        latents, cond, uncond, num_inference_steps=STEPS, cfg_scale=scales, batched_cfg=batched_cfg
    )
    ours = np.asarray(ours_pipe.decode(z))[:, 0]
    if torch_pipe is None:
        return ours, None
    packed = np.asarray(flux_transformer.pack_latents(latents))
    reference = []
    for row, given in enumerate(controls):
        reference.append(
            torch_pipe(
                prompt=PROMPTS[row],
                negative_prompt=None if negative is None else negative[row],
                true_cfg_scale=true_cfg,
                guidance_scale=3.5,
                height=HEIGHT,
                width=WIDTH,
                num_inference_steps=STEPS,
                latents=torch.from_numpy(packed[row : row + 1]),
                max_sequence_length=LENGTH,
                output_type="np",
                generator=torch.Generator().manual_seed(row),
                **_diffusers_kwargs(given, multi),
            ).images[0]
        )
    return ours, np.stack(reference)


def _plain_controls():
    """Row 0: scale 0.7, on for steps 1..2 of 3 (start 1/3 falls on a step); row 1: scale
    1.3, on for steps 0..1 (end 2/3 falls on a step); images of other sizes, row 1's
    single-channel."""
    return [
        control.ControlInput((_image(0, (24, 40)),), (0.7,), (1 / 3,), (1.0,)),
        control.ControlInput((_image(1, (20, 12), "L"),), (1.3,), (0.0,), (2 / 3,)),
    ]


def test_loads_flux_controlnets(plain, multi):
    ours, _ = plain
    assert ours.family.name == "flux" and len(ours.controlnets) == 1
    assert ours.controlnets.sources[0].endswith("controlnet")
    two, _ = multi
    assert [s.rsplit("/", 1)[1] for s in two.controlnets.sources] == [
        "controlnet",
        "controlnet_1",
    ]


def test_plain_controlnet_scales_windows_and_images_match_diffusers(plain):
    ours, reference = _render(plain, _plain_controls())
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)
    # the control matters: no ControlNet input at scale 0 renders otherwise
    off = [control.ControlInput(c.images, (0.0,), c.starts, c.ends) for c in _plain_controls()]
    without, _ = _render((plain[0], None), off)
    assert np.abs(ours - without).max() > 1e-3


def test_true_cfg_gives_the_negative_branch_the_positive_residuals(plain):
    controls = _plain_controls()
    ours, reference = _render(plain, controls, true_cfg=4.0, negative=NEGATIVE)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)
    # the branches as two calls: the negative one still reads the positive prompt
    alone, _ = _render(
        (plain[0], None), controls, true_cfg=4.0, negative=NEGATIVE, batched_cfg=False
    )
    np.testing.assert_allclose(alone, reference, atol=TOLERANCE, rtol=0)


def test_union_controlnet_modes_match_diffusers(union_dir):
    pipes = load_pipeline(union_dir), load_diffusers_controlnet_pipeline(union_dir)
    controls = [
        control.ControlInput((_image(2, (16, 16)),), (0.8,), (0.0,), (1.0,), modes=(0,)),
        control.ControlInput((_image(2, (16, 16)),), (1.2,), (0.0,), (1.0,), modes=(2,)),
    ]
    ours, reference = _render(pipes, controls)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)
    assert np.abs(ours[0] - ours[1]).max() > 1e-3


def test_union_controlnet_with_several_conditions_matches_diffusers(union_dir):
    """One union ControlNet, two (image, mode) conditions per row (diffusers: a
    FluxMultiControlNetModel of that one net)."""
    pipes = load_pipeline(union_dir), load_diffusers_controlnet_pipeline(union_dir, multi=True)
    images = (_image(3, (16, 16)), _image(4, (32, 32)))
    controls = [
        control.ControlInput(images, (0.6, 0.9), (0.0, 1 / 3), (1.0, 1.0), modes=(1, 2)),
        control.ControlInput(images, (1.1, 0.5), (0.0, 0.0), (2 / 3, 1.0), modes=(0, 1)),
    ]
    ours, reference = _render(pipes, controls, multi=True)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_two_controlnets_match_diffusers(multi):
    images = (_image(5, (16, 16)), _image(6, (24, 24)))
    controls = [
        control.ControlInput(images, (0.7, 1.2), (0.0, 1 / 3), (2 / 3, 1.0)),
        control.ControlInput(images, (1.0, 0.4), (1 / 3, 0.0), (1.0, 1.0)),
    ]
    ours, reference = _render(multi, controls, multi=True)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_refuses_guess_mode_and_missing_modes(plain, union_dir):
    ours, _ = plain
    guess = control.ControlInput((_image(0, (16, 16)),), (1.0,), (0.0,), (1.0,), guess_mode=True)
    with pytest.raises(FamilyError, match="guess_mode"):
        ours.conditioning(
            PROMPTS[:1], [""], [ours.guidance(3.5)], LENGTH, size=(16, 16, 1), controls=[guess]
        )
    union = load_pipeline(union_dir)
    no_mode = control.ControlInput((_image(0, (16, 16)),), (1.0,), (0.0,), (1.0,))
    with pytest.raises(FamilyError, match="union ControlNet needs a mode"):
        union.conditioning(
            PROMPTS[:1], [""], [union.guidance(3.5)], LENGTH, size=(16, 16, 1), controls=[no_mode]
        )


def test_controlnet_with_input_hint_block_matches_diffusers(tmp_path):
    """An XLabs-style ControlNet: pixels through its ``input_hint_block`` (8x down) instead of
    VAE latents, residuals cycled over the blocks (``controlnet_blocks_repeat``: its 2 double
    block samples go to the 4 double blocks as 0 1 0 1, not 0 0 1 1). Its tokens match the latents'
    at 8x, so the tiny VAE here downsamples 4x (three levels)."""
    folder = build_flux_controlnet_pipeline(
        tmp_path / "hint",
        seed=4,
        controlnet={"conditioning_embedding_channels": 16, "num_layers": 2},
        transformer={"num_layers": 4},
        vae={
            "block_out_channels": (8, 16, 16),
            "down_block_types": ("DownEncoderBlock2D",) * 3,
            "up_block_types": ("UpDecoderBlock2D",) * 3,
        },
    )
    pipes = load_pipeline(folder), load_diffusers_controlnet_pipeline(folder)
    assert pipes[1].controlnet.input_hint_block is not None
    ours, reference = _render(pipes, _plain_controls())
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)
