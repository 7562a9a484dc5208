"""Wan 2.2 and image-to-video vs diffusers' WanPipeline / WanImageToVideoPipeline (tiny, fp32).

Tiny random-init pipelines (tests/support/wan_variants.py) are loaded by both; both render the
same prompts from the same initial latents (and the same conditioning images). Asserted at
1e-4 on [0, 1] pixels; reached values are stated per test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxcore import sampling
from jaxcore.compute import ComputeConfig
from jaxcore.families import FamilyError, load_pipeline
from jaxcore.sampling import initial_latents
from tests.support import wan_variants

TOLERANCE = 1e-4
PROMPTS = ["a red circle", "blue square moving left"]
NEGATIVE = ["dark background", ""]


def _render_ours(pipe, latents, *, steps, guidance, guidance_2=None, images=None, size, **kw):
    guidances = [pipe.guidance(guidance, guidance_scale_2=guidance_2)] * len(PROMPTS)
    cond, uncond, scales = pipe.conditioning(
        PROMPTS, NEGATIVE, guidances, 512, images=images, size=size
    )
    z = pipe.sample(latents, cond, uncond, num_inference_steps=steps, cfg_scale=scales, **kw)
    return np.asarray(pipe.decode(z))


# --- two experts (Wan 2.2 A14B text-to-video) ---------------------------------------------------


@pytest.fixture(scope="module")
def two_expert_dir(tmp_path_factory):
    return wan_variants.build_two_expert_pipeline(tmp_path_factory.mktemp("wan22_t2v"))


@pytest.fixture(scope="module")
def two_expert_pipes(two_expert_dir):
    from diffusers import WanPipeline

    return load_pipeline(two_expert_dir), WanPipeline.from_pretrained(two_expert_dir)


@pytest.mark.parametrize(
    ("guidance", "guidance_2", "frames", "steps"),
    [
        pytest.param(4.0, None, 1, 4, marks=pytest.mark.slow),
        (4.0, 2.0, 5, 3),
        pytest.param(1.0, 3.0, 1, 4, marks=pytest.mark.slow),
    ],
)
def test_two_experts_match_diffusers(two_expert_pipes, guidance, guidance_2, frames, steps):
    """Reached: max |diff| ~3e-6. (1.0, 3.0): diffusers runs no CFG at all when
    guidance_scale <= 1, whatever guidance_scale_2 is; so do we."""
    ours, theirs = two_expert_pipes
    shape = ours.latent_shape(16, 16, frames)
    latents = np.stack([initial_latents(s, shape) for s in (3, 4)])
    got = _render_ours(
        ours, latents, steps=steps, guidance=guidance, guidance_2=guidance_2, size=(16, 16, frames)
    )
    ref = theirs(
        prompt=PROMPTS,
        negative_prompt=NEGATIVE,
        height=16,
        width=16,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=guidance,
        guidance_scale_2=guidance_2,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).frames
    np.testing.assert_allclose(got, ref, atol=TOLERANCE, rtol=0)


def test_the_second_expert_matters(two_expert_pipes):
    """Without it (one expert for all steps) the render differs: the parity above is not
    vacuous."""
    ours, _ = two_expert_pipes
    shape = ours.latent_shape(16, 16, 1)
    latents = np.stack([initial_latents(s, shape) for s in (3, 4)])
    both = _render_ours(ours, latents, steps=4, guidance=1.0, size=(16, 16, 1))
    expert, ours.second_expert = ours.second_expert, None
    try:
        first_only = _render_ours(ours, latents, steps=4, guidance=1.0, size=(16, 16, 1))
    finally:
        ours.second_expert = expert
    assert np.abs(both - first_only).max() > 1e-3


@pytest.mark.parametrize("ratio", [0.875, 0.9, 0.5])
@pytest.mark.parametrize("steps", [2, 7, 10, 40])
@pytest.mark.parametrize("shift", [1.0, 5.0, 12.0])
def test_expert_switch_step_matches_diffusers(ratio, steps, shift):
    """Our switch step vs the comparison diffusers makes (``t >= boundary_ratio * 1000`` on
    its scheduler's timesteps, in torch's type promotion)."""
    from diffusers import UniPCMultistepScheduler

    from jaxcore.families.wan import REFERENCE_SCHEDULER_CONFIG as UNIPC_SCHEDULER_CONFIG
    from jaxcore.schedulers import make_scheduler

    config = {k: v for k, v in UNIPC_SCHEDULER_CONFIG.items() if not k.startswith("_")}
    scheduler = UniPCMultistepScheduler(**{**config, "flow_shift": shift})
    scheduler.set_timesteps(steps)
    boundary = ratio * scheduler.config.num_train_timesteps
    theirs = sum(bool(t >= boundary) for t in scheduler.timesteps)
    state, _ = make_scheduler("unipc", steps, shift, sample_shape=(1, 4, 1, 2, 2))
    ours = sampling.first_expert_steps(state.timesteps, sampling.boundary_timestep(ratio, 1000))
    assert ours == theirs


def test_boundary_rounds_like_torch():
    """0.9 * 1000 is 900.0000000000001 in Python; torch compares in float32, where t = 900
    is at the boundary (first expert)."""
    boundary = sampling.boundary_timestep(0.9, 1000)
    assert torch.tensor(900) >= 0.9 * 1000
    assert sampling.first_expert_steps(np.array([900.0, 899.0]), boundary) == 1


@pytest.mark.parametrize(("guidance", "guidance_2"), [(4.0, 2.0), (1.0, 3.0), (4.0, 1.0)])
def test_idle_expert_on_host_renders_the_same(
    two_expert_dir, two_expert_pipes, guidance, guidance_2
):
    """compute.idle_expert=host: one expert's weights on the device at a time, swapped at the
    boundary; the result equals the one-loop render bit for bit (same ops, same order)."""
    ours, _ = two_expert_pipes
    swapping = load_pipeline(two_expert_dir, ComputeConfig(idle_expert="host"))
    assert swapping.denoiser_params is None and swapping.second_expert.params is None
    shape = ours.latent_shape(16, 16, 1)
    latents = np.stack([initial_latents(s, shape) for s in (3, 4)])
    kw = dict(steps=4, guidance=guidance, guidance_2=guidance_2, size=(16, 16, 1))
    np.testing.assert_allclose(
        _render_ours(swapping, latents, **kw), _render_ours(ours, latents, **kw), atol=1e-6
    )


def test_guidance_scale_2_needs_two_experts(tmp_path):
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    pipe = load_pipeline(build_tiny_wan_pipeline(tmp_path / "wan21"))
    with pytest.raises(FamilyError, match="guidance_scale_2=3.0: the pipeline has one"):
        pipe.guidance(4.0, guidance_scale_2=3.0)


# --- image-to-video --------------------------------------------------------------------------


def _image(seed: int, size=(23, 31)):
    """A random RGB image of another size than the render (both pipelines resize it)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size + (3,), dtype=np.uint8))


def _i2v_reference(directory, latents, *, frames, steps, guidance, guidance_2=None, last=False):
    from diffusers import WanImageToVideoPipeline

    theirs = WanImageToVideoPipeline.from_pretrained(directory)
    kwargs = {"last_image": _image(2, (19, 27))} if last else {}
    return theirs(
        image=_image(1),
        prompt=PROMPTS,
        negative_prompt=NEGATIVE,
        height=16,
        width=16,
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=guidance,
        guidance_scale_2=guidance_2,
        latents=torch.from_numpy(latents),
        output_type="np",
        **kwargs,
    ).frames


def _i2v_ours(directory, latents, *, frames, steps, guidance, guidance_2=None, last=False):
    ours = load_pipeline(directory)
    images = [(_image(1), _image(2, (19, 27)) if last else None)] * len(PROMPTS)
    return _render_ours(
        ours,
        latents,
        steps=steps,
        guidance=guidance,
        guidance_2=guidance_2,
        images=images,
        size=(16, 16, frames),
    )


def _noise(directory, frames):
    shape = load_pipeline(directory).latent_shape(16, 16, frames)
    return np.stack([initial_latents(s, shape) for s in (3, 4)])


@pytest.mark.slow  # the FLF2V test below covers the CLIP path in the default tier
@pytest.mark.parametrize(("guidance", "frames"), [(1.0, 5), (4.0, 1)])
def test_wan21_i2v_matches_diffusers(tmp_path, guidance, frames):
    """Wan 2.1 I2V: mask + encoded clip concatenated, CLIP penultimate states into the image
    cross-attention. Reached: max |diff| ~3e-6."""
    directory = wan_variants.build_i2v_pipeline(tmp_path / "i2v")
    latents = _noise(directory, frames)
    kw = dict(frames=frames, steps=3, guidance=guidance)
    ours = _i2v_ours(directory, latents, **kw)
    np.testing.assert_allclose(ours, _i2v_reference(directory, latents, **kw), atol=TOLERANCE)


def test_wan21_flf2v_matches_diffusers(tmp_path):
    """First-last-frame: two CLIP embeddings with learned positions, the last frame masked in."""
    directory = wan_variants.build_i2v_pipeline(tmp_path / "flf2v", flf2v=True)
    latents = _noise(directory, 5)
    kw = dict(frames=5, steps=3, guidance=3.0, last=True)
    ours = _i2v_ours(directory, latents, **kw)
    np.testing.assert_allclose(ours, _i2v_reference(directory, latents, **kw), atol=TOLERANCE)


@pytest.mark.parametrize("last", [pytest.param(False, marks=pytest.mark.slow), True])
def test_wan22_i2v_two_experts_match_diffusers(tmp_path, last):
    """Wan 2.2 I2V A14B: no image encoder, two experts (boundary 0.9), guidance_scale_2."""
    directory = wan_variants.build_i2v_pipeline(
        tmp_path / "i2v22", image_encoder=False, second_expert=True
    )
    latents = _noise(directory, 5)
    kw = dict(frames=5, steps=4, guidance=3.5, guidance_2=2.0, last=last)
    ours = _i2v_ours(directory, latents, **kw)
    np.testing.assert_allclose(ours, _i2v_reference(directory, latents, **kw), atol=TOLERANCE)


@pytest.fixture(scope="module")
def ti2v_dir(tmp_path_factory):
    return wan_variants.build_ti2v_pipeline(tmp_path_factory.mktemp("ti2v"))


@pytest.mark.parametrize("guidance", [pytest.param(1.0, marks=pytest.mark.slow), 4.0])
def test_ti2v_text_to_video_matches_diffusers(ti2v_dir, guidance):
    """TI2V without an image: WanPipeline with expand_timesteps (per-token timesteps, all t)."""
    from diffusers import WanPipeline

    latents = _noise(ti2v_dir, 5)
    ours = _render_ours(
        load_pipeline(ti2v_dir), latents, steps=3, guidance=guidance, size=(16, 16, 5)
    )
    ref = WanPipeline.from_pretrained(ti2v_dir)(
        prompt=PROMPTS,
        negative_prompt=NEGATIVE,
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=3,
        guidance_scale=guidance,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).frames
    np.testing.assert_allclose(ours, ref, atol=TOLERANCE)


@pytest.mark.parametrize("guidance", [pytest.param(1.0, marks=pytest.mark.slow), 4.0])
def test_ti2v_image_to_video_matches_diffusers(ti2v_dir, guidance):
    """TI2V with an image: its latent replaces the first frame, whose tokens get timestep 0."""
    latents = _noise(ti2v_dir, 5)
    kw = dict(frames=5, steps=3, guidance=guidance)
    ours = _i2v_ours(ti2v_dir, latents, **kw)
    np.testing.assert_allclose(ours, _i2v_reference(ti2v_dir, latents, **kw), atol=TOLERANCE)


def test_image_inputs_are_checked(tmp_path, ti2v_dir):
    i2v = load_pipeline(wan_variants.build_i2v_pipeline(tmp_path / "i2v"))
    assert i2v.image_inputs.image == "required" and not i2v.image_inputs.last_image
    guidances = [i2v.guidance(1.0)] * 2
    with pytest.raises(FamilyError, match="row 1: .*needs an 'image'"):
        i2v.conditioning(
            PROMPTS,
            NEGATIVE,
            guidances,
            16,
            images=[(_image(1), None), (None, None)],
            size=(16, 16, 5),
        )
    with pytest.raises(FamilyError, match="takes no 'last_image'"):
        i2v.conditioning(
            PROMPTS, NEGATIVE, guidances, 16, images=[(_image(1), _image(2))] * 2, size=(16, 16, 5)
        )
    ti2v = load_pipeline(ti2v_dir)
    assert ti2v.image_inputs.image == "optional"
