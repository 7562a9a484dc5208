"""SD / SDXL ControlNet pipelines vs diffusers' ``StableDiffusionControlNetPipeline`` and
``StableDiffusionXLControlNetPipeline`` on tiny random-init pipelines (tests/support/tiny_sd.py).

Both render from the same per-prompt latents and control images; diffusers takes one setting
per call, so each of our rows is compared with a diffusers call made with that row's settings
(our batch mixes them). Asserted: max |diff| <= 1e-4 on [0, 1] pixels (fp32, CPU); reached values
in each test's docstring.
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from jaxcore import control
from jaxcore.families import load_pipeline
from jaxcore.family_types import FamilyError
from jaxcore.sampling import initial_latents
from tests.support.tiny_sd import build_controlnet_pipeline

TOLERANCE = 1e-4
PROMPTS = ["a red circle on a white background", "blue square"]
NEGATIVE = ["dark background", ""]
SEEDS = (3, 4)
# SD with a multistep solver and Karras sigmas
KARRAS = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    use_karras_sigmas=True,
    algorithm_type="dpmsolver++",
    solver_order=2,
)
# SDXL with Euler and trailing spacing
EULER_TRAILING = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    timestep_spacing="trailing",
)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pipes(directory, cls_name):
    import diffusers

    return load_pipeline(directory), getattr(diffusers, cls_name).from_pretrained(directory)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    directory = build_controlnet_pipeline(
        tmp_path_factory.mktemp("sd_cn"),
        seed=1,
        scheduler="DPMSolverMultistepScheduler",
        schedule=KARRAS,
    )
    return _pipes(directory, "StableDiffusionControlNetPipeline")


@pytest.fixture(scope="module")
def sd_multi(tmp_path_factory):
    directory = build_controlnet_pipeline(tmp_path_factory.mktemp("sd_cn2"), seed=2, count=2)
    return _pipes(directory, "StableDiffusionControlNetPipeline")


@pytest.fixture(scope="module")
def xl(tmp_path_factory):
    directory = build_controlnet_pipeline(
        tmp_path_factory.mktemp("xl_cn"),
        xl=True,
        seed=3,
        scheduler="EulerDiscreteScheduler",
        schedule=EULER_TRAILING,
    )
    return _pipes(directory, "StableDiffusionXLControlNetPipeline")


@pytest.fixture(scope="module")
def xl_union(tmp_path_factory):
    directory = build_controlnet_pipeline(
        tmp_path_factory.mktemp("xl_union"), xl=True, seed=5, union=True
    )
    return _pipes(directory, "StableDiffusionXLControlNetUnionPipeline")


def _control_image(seed: int, size=(20, 12), mode="RGB") -> Image.Image:
    """A random control image of another size than the render's (both resize it)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels).convert(mode)


def _render(pipes, rows, *, height=16, width=24, steps=4, guidance=6.0):
    """rows: per prompt ``dict(images=[PIL], scales=[..], starts=[..], ends=[..], guess=bool)``;
    returns (ours [B, H, W, 3], diffusers' per row)."""
    import torch

    ours_pipe, torch_pipe = pipes
    count = len(rows)
    shape = ours_pipe.latent_shape(height, width, 1)
    latents = np.stack([initial_latents(seed, shape) for seed in SEEDS[:count]])
    inputs = [
        control.ControlInput(
            tuple(r["images"]),
            tuple(r["scales"]),
            tuple(r["starts"]),
            tuple(r["ends"]),
            r.get("guess", False),
            tuple(r.get("modes", ())),
        )
        for r in rows
    ]
    guidance_ = ours_pipe.guidance(guidance)
    cond, uncond, scales = ours_pipe.conditioning(
        PROMPTS[:count],
        NEGATIVE[:count],
        [guidance_] * count,
        77,
        size=(height, width, 1),
        controls=inputs,
    )
    z = ours_pipe.sample(latents, cond, uncond, num_inference_steps=steps, cfg_scale=scales)
    ours = np.asarray(ours_pipe.decode(z))[:, 0]
    references = []
    for row, r in enumerate(rows):
        single = len(r["images"]) == 1 and "modes" not in r
        unwrap = (lambda v: v[0]) if single else list  # noqa: E731
        images = {"image": unwrap(r["images"])}
        if "modes" in r:  # the union pipeline's names
            images = {"control_image": list(r["images"]), "control_mode": list(r["modes"])}
        references.append(
            torch_pipe(
                prompt=PROMPTS[row],
                negative_prompt=NEGATIVE[row] or None,  # "" is no negative: SDXL zeros
                **images,
                controlnet_conditioning_scale=unwrap(r["scales"]),
                control_guidance_start=unwrap(r["starts"]),
                control_guidance_end=unwrap(r["ends"]),
                guess_mode=r.get("guess", False),
                guidance_scale=guidance,
                height=height,
                width=width,
                num_inference_steps=steps,
                latents=torch.from_numpy(latents[row : row + 1]),
                output_type="np",
            ).images[0]
        )
    return ours, np.stack(references)


def _close(ours, reference):
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_sd_karras_multistep_matches_diffusers(sd):
    """Scales != 1, a window whose edges fall on steps (0.25 and 0.75 of 4), guess mode on one
    row, a single-channel control image on the other."""
    rows = [
        dict(images=[_control_image(0)], scales=[0.6], starts=[0.25], ends=[0.75]),
        dict(
            images=[_control_image(1, mode="L")],
            scales=[1.4],
            starts=[0.0],
            ends=[1.0],
            guess=True,
        ),
    ]
    ours, reference = _render(sd, rows)
    _close(ours, reference)


def test_sd_without_cfg_matches_diffusers(sd):
    rows = [dict(images=[_control_image(2)], scales=[0.8], starts=[0.0], ends=[0.5])]
    ours, reference = _render(sd, rows, guidance=1.0)
    _close(ours, reference)


def test_multi_controlnet_matches_diffusers(sd_multi):
    """Two ControlNets, each with its own image, scale and window (diffusers'
    MultiControlNetModel saved as controlnet + controlnet_1)."""
    assert len(sd_multi[0].controlnets) == 2
    rows = [
        dict(
            images=[_control_image(3), _control_image(4, size=(8, 8))],
            scales=[0.5, 1.2],
            starts=[0.0, 0.5],
            ends=[0.5, 1.0],
        )
    ]
    ours, reference = _render(sd_multi, rows, steps=4)
    _close(ours, reference)


def test_sdxl_euler_trailing_matches_diffusers(xl):
    rows = [
        dict(images=[_control_image(5)], scales=[0.7], starts=[0.0], ends=[0.75]),
        dict(images=[_control_image(6, mode="L")], scales=[1.0], starts=[0.25], ends=[1.0]),
    ]
    ours, reference = _render(xl, rows, height=24, width=16)
    _close(ours, reference)


def test_sdxl_union_matches_diffusers(xl_union):
    """One union ControlNet: two rows with one image each (modes 2 and 0); then two images of
    two modes with their own scales and windows. (diffusers' union pipeline fails in guess
    mode with CFG: it repeats control_type for both CFG halves but runs the ControlNet on one.)"""
    one = [
        dict(images=[_control_image(9)], scales=[0.9], starts=[0.0], ends=[0.75], modes=[2]),
        dict(
            images=[_control_image(10, mode="L")],
            scales=[1.2],
            starts=[0.25],
            ends=[1.0],
            modes=[0],
        ),
    ]
    ours, reference = _render(xl_union, one, height=24, width=16)
    _close(ours, reference)
    two = [
        dict(
            images=[_control_image(11), _control_image(12)],
            scales=[0.6, 1.3],
            starts=[0.0, 0.5],
            ends=[0.5, 1.0],
            modes=[1, 3],
        )
    ]
    ours, reference = _render(xl_union, two, height=24, width=16)
    _close(ours, reference)


def test_control_changes_the_render(sd):
    """The ControlNet really steers: another control image, another render."""
    base = dict(scales=[1.0], starts=[0.0], ends=[1.0])
    a, _ = _render_ours(sd, [dict(images=[_control_image(7)], **base)])
    b, _ = _render_ours(sd, [dict(images=[_control_image(8)], **base)])
    assert np.abs(a - b).max() > 1e-3


def _render_ours(pipes, rows):
    ours_pipe = pipes[0]
    inputs = [
        control.ControlInput(
            tuple(r["images"]), tuple(r["scales"]), tuple(r["starts"]), tuple(r["ends"])
        )
        for r in rows
    ]
    frames = ours_pipe(
        PROMPTS[: len(rows)],
        height=16,
        width=16,
        num_inference_steps=2,
        guidance_scale=1.0,
        controls=inputs,
    )
    return frames, None


def test_missing_or_extra_control_inputs_are_refused(sd):
    ours = sd[0]
    with pytest.raises(FamilyError, match="control image"):
        ours(PROMPTS[:1], height=16, width=16, num_inference_steps=1, guidance_scale=1.0)
    rows = [control.ControlInput((_control_image(0),) * 2, (1.0, 1.0), (0.0, 0.0), (1.0, 1.0))]
    with pytest.raises(FamilyError, match="2 control image"):
        ours(
            PROMPTS[:1],
            height=16,
            width=16,
            num_inference_steps=1,
            guidance_scale=1.0,
            controls=rows,
        )


def test_keep_table_is_diffusers_float64_rule():
    """An edge that falls on a step boundary keeps diffusers' strict comparisons."""
    table = control.keep_table(np.array([[0.25, 0.3]]), np.array([[0.75, 0.7]]), 10)
    expected_first = [1.0 - float(i / 10 < 0.25 or (i + 1) / 10 > 0.75) for i in range(10)]
    expected_second = [1.0 - float(i / 10 < 0.3 or (i + 1) / 10 > 0.7) for i in range(10)]
    np.testing.assert_array_equal(table[0, :, 0], expected_first)
    np.testing.assert_array_equal(table[0, :, 1], expected_second)


def test_sharded_controlnet_render_equals_one_device(sd_multi):
    """Two ControlNets on a (data 2, fsdp 2, tensor 2) mesh of 8 devices: the ControlNets'
    weights placed by the same logical rules as the UNet's; equal to one device within 1e-5."""
    import jax

    from jaxcore.compute import ComputeConfig
    from jaxcore.sharding import MeshConfig, make_mesh

    directory = sd_multi[0].source
    mesh = make_mesh(
        MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2)
    )
    sharded = load_pipeline(directory, ComputeConfig(), mesh)
    single = load_pipeline(directory, ComputeConfig(), make_mesh(devices=jax.devices()[:1]))
    inputs = [
        control.ControlInput(
            (_control_image(20 + k), _control_image(30 + k)),
            (0.5 + 0.25 * k, 1.0),
            (0.0, 0.25),
            (1.0, 0.75),
            k % 2 == 1,
        )
        for k in range(4)
    ]

    def render(pipe):
        guidance = pipe.guidance(5.0)
        cond, uncond, scales = pipe.conditioning(
            ["a"] * 4, ["b"] * 4, [guidance] * 4, 77, size=(16, 16, 1), controls=inputs
        )
        latents = np.stack([initial_latents(s, pipe.latent_shape(16, 16, 1)) for s in range(4)])
        z = pipe.sample(latents, cond, uncond, num_inference_steps=3, cfg_scale=scales)
        return np.asarray(pipe.decode(z))

    assert sharded.batch_ways == 4
    np.testing.assert_allclose(render(sharded), render(single), atol=1e-5, rtol=0)
