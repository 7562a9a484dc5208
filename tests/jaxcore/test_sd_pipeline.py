"""The SD family vs diffusers ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline`` on
tiny random-init pipelines.

The pipelines are built with diffusers/transformers (every weight perturbed) and saved with
``save_pretrained`` (tests/support/tiny_sd.py); diffusers renders from the saved directory, as a
user of it would, with its scheduler swapped by ``SchedulerClass.from_config`` where a case
names one (ours reads the same config under the scheduler's name). Both render the same prompts
from the same standard-normal latents (diffusers multiplies them by ``init_noise_sigma`` inside
``prepare_latents``, ours in ``Pipeline.sample``). Asserted: max |diff| <= 1e-4 on [0, 1]
pixels. Reached (fp32, CPU, 2 prompts with CFG and negative prompts unless said): SD 2-base-like
PNDM (its default) 5.5e-6, DDIM 1.1e-5, Euler 7.0e-6; v-prediction + zero-SNR trailing DDIM with
guidance_rescale 0.7 (no negative) 7.6e-6; v zero-SNR Euler 1.1e-4 (slow; bound 3e-4, see the
test); SDXL-like DPM++ 2M Karras 16x24 5.0e-6, Euler (Karras config) 24x16 4.7e-6, empty
negative -> zeros 2.9e-6, Euler ancestral with diffusers' step noise replaced by ours 4.9e-6.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxcore import families
from jaxcore.families import load_pipeline
from jaxcore.models import unet_2d_condition as unet
from jaxcore.sampling import initial_latents
from jaxcore.schedulers import classic
from tests.support.tiny_sd import V_ZERO_SNR_SCHEDULE, build_sd_pipeline, build_sdxl_pipeline

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
PROMPTS = ["a red circle on a white background", "blue square"]
NEGATIVE = ["dark background", "green"]
SEEDS = (3, 4)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The tiny torch models run far faster on one thread next to XLA's on 2 shared cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pipes(directory, cls_name: str):
    import diffusers

    return load_pipeline(directory), getattr(diffusers, cls_name).from_pretrained(directory)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """SD 2-base-like: PNDM scheduler config (with DDIM's clip_sample=false), epsilon."""
    return _pipes(
        build_sd_pipeline(tmp_path_factory.mktemp("sd2"), seed=1), "StableDiffusionPipeline"
    )


@pytest.fixture(scope="module")
def sd_v(tmp_path_factory):
    """v-prediction, zero-terminal-SNR betas, trailing spacing (DDIM config)."""
    directory = build_sd_pipeline(
        tmp_path_factory.mktemp("sd2_v"),
        seed=2,
        scheduler="DDIMScheduler",
        schedule=V_ZERO_SNR_SCHEDULE,
    )
    return _pipes(directory, "StableDiffusionPipeline")


@pytest.fixture(scope="module")
def xl(tmp_path_factory):
    """SDXL-like with a DPM++ 2M Karras scheduler config."""
    directory = build_sdxl_pipeline(tmp_path_factory.mktemp("sdxl"), seed=3)
    return _pipes(directory, "StableDiffusionXLPipeline")


def _render(
    pipes,
    *,
    scheduler=None,
    torch_scheduler=None,
    height=16,
    width=16,
    steps=3,
    guidance=7.5,
    negative=NEGATIVE,
    rescale=0.0,
    seeds=None,
    torch_noise=None,
    reference=True,
    micro=None,
    count=len(PROMPTS),
):
    """(ours [B, H, W, 3], diffusers' [B, H, W, 3] or None without ``reference``) from the same
    per-prompt latents.

    ``torch_noise``: ``[N, B, ...]`` noise diffusers' stochastic scheduler draws per step;
    ``micro``: SDXL micro-conditioning arguments, the same for every prompt; ``count``: render
    the first ``count`` prompts only."""
    import diffusers
    import torch

    ours_pipe, torch_pipe = pipes
    shape = ours_pipe.latent_shape(height, width, 1)
    prompts = PROMPTS[:count]
    negative = negative[:count] if negative else None
    latents = np.stack([initial_latents(seed, shape) for seed in SEEDS[:count]])
    guidance_ = ours_pipe.guidance(guidance, guidance_rescale=rescale)
    cond, uncond, scales = ours_pipe.conditioning(
        prompts,
        negative or [""] * count,
        [guidance_] * count,
        77,
        size=(height, width, 1),
        micro_conditioning=[micro or {}] * count,
    )
    z = ours_pipe.sample(
        latents,
        cond,
        uncond,
        num_inference_steps=steps,
        cfg_scale=scales,
        scheduler=scheduler,
        guidance_rescale=guidance_.guidance_rescale,
        seeds=seeds,
    )
    ours = np.asarray(ours_pipe.decode(z))[:, 0]
    if not reference:
        return ours, None
    original = torch_pipe.scheduler
    if torch_scheduler is not None:
        torch_pipe.scheduler = getattr(diffusers, torch_scheduler).from_config(original.config)
    patch = pytest.MonkeyPatch()
    if torch_noise is not None:
        from diffusers.schedulers import scheduling_euler_ancestral_discrete as module

        draws = iter(torch.from_numpy(np.asarray(step)) for step in torch_noise)
        patch.setattr(module, "randn_tensor", lambda *args, **kwargs: next(draws))
    try:
        reference = torch_pipe(
            prompt=prompts,
            negative_prompt=negative,
            guidance_scale=guidance,
            guidance_rescale=rescale,
            height=height,
            width=width,
            num_inference_steps=steps,
            latents=torch.from_numpy(latents),
            output_type="np",
            **{name: tuple(pair) for name, pair in (micro or {}).items()},
        ).images
    finally:
        torch_pipe.scheduler = original
        patch.undo()
    return ours, reference


def _close(ours, reference):
    assert ours.shape == reference.shape
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


# --- SD 2.x ---------------------------------------------------------------------------------------


def test_loads_as_the_sd_family(sd, xl):
    ours, _ = sd
    assert ours.family.name == "sd" and ours.default_scheduler == "pndm"
    assert ours.latent_shape(16, 24, 1) == (4, 8, 12)
    assert (ours.geometry.spatial_multiple, ours.geometry.temporal_multiple) == (8, 0)
    assert ours.family.pipeline_objective(ours) == "epsilon"
    defaults = ours.family.sampling_defaults(ours.configs)
    assert (defaults["height"], defaults["guidance_scale"]) == (16, 7.5)
    xl_ours, _ = xl
    assert xl_ours.default_scheduler == "dpmsolver_multistep"
    assert xl_ours.family.sampling_defaults(xl_ours.configs)["guidance_scale"] == 5.0


@pytest.mark.parametrize(
    ("scheduler", "torch_scheduler"),
    [(None, None), ("ddim", "DDIMScheduler"), ("euler", "EulerDiscreteScheduler")],
    ids=["pndm-default", "ddim", "euler"],
)
def test_sd2_cfg_with_negative_matches_diffusers(sd, scheduler, torch_scheduler):
    ours, reference = _render(sd, scheduler=scheduler, torch_scheduler=torch_scheduler, steps=4)
    _close(ours, reference)


def test_v_prediction_zero_snr_guidance_rescale_matches_diffusers(sd_v):
    ours_pipe, _ = sd_v
    assert ours_pipe.family.pipeline_objective(ours_pipe) == "v_prediction"
    ours, reference = _render(sd_v, steps=3, rescale=0.7, negative=None)
    _close(ours, reference)


@pytest.mark.slow
def test_v_prediction_zero_snr_euler_matches_diffusers(sd_v):
    """Zero-SNR Euler starts at sigma 4096 (latents x 4096): the first step cancels numbers of
    that size, so float32 leaves ~4096 x 6e-8 = 2.4e-4 of the latent scale to either side; here
    the bound is 3e-4 (reached 1.1e-4)."""
    ours, reference = _render(sd_v, scheduler="euler", torch_scheduler="EulerDiscreteScheduler")
    np.testing.assert_allclose(ours, reference, atol=3e-4, rtol=0)


def test_settings_change_the_render(sd):
    """The parity tests would pass vacuously if nothing depended on these settings."""
    base, _ = _render(sd, scheduler="ddim", steps=2, reference=False)
    no_negative, _ = _render(sd, scheduler="ddim", steps=2, negative=None, reference=False)
    rescaled, _ = _render(sd, scheduler="ddim", steps=2, rescale=0.7, reference=False)
    for other in (no_negative, rescaled):
        assert np.abs(base - other).max() > 1e-3
    assert np.abs(base[0] - base[1]).max() > 1e-3  # the prompt matters


# --- SDXL -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheduler", "torch_scheduler", "height", "width"),
    [(None, None, 16, 24), ("euler", "EulerDiscreteScheduler", 24, 16)],
    ids=["dpm++2m-karras-16x24", "euler-karras-24x16"],
)
def test_sdxl_matches_diffusers(xl, scheduler, torch_scheduler, height, width):
    ours, reference = _render(
        xl,
        scheduler=scheduler,
        torch_scheduler=torch_scheduler,
        height=height,
        width=width,
        guidance=5.0,
    )
    _close(ours, reference)


def test_sdxl_empty_negative_is_zeros_as_diffusers(xl):
    """force_zeros_for_empty_prompt: no negative prompt -> zero embeddings (diffusers'
    ``negative_prompt=None``); the render matches, and differs from an encoded negative."""
    ours_pipe, _ = xl
    guidance = ours_pipe.guidance(5.0)
    _, uncond, _ = ours_pipe.conditioning(PROMPTS, ["", "x"], [guidance] * 2, 77, size=(16, 16, 1))
    assert not uncond["encoder_hidden_states"][0].any() and not uncond["text_embeds"][0].any()
    assert uncond["encoder_hidden_states"][1].any()
    np.testing.assert_array_equal(uncond["time_ids"], [[16, 16, 0, 0, 16, 16]] * 2)
    ours, reference = _render(xl, steps=2, guidance=5.0, negative=None)
    _close(ours, reference)


MICRO = {
    "original_size": (64, 96),
    "crops_coords_top_left": (8, 4),
    "target_size": (24, 40),
    "negative_original_size": (12, 12),
    "negative_crops_coords_top_left": (2, 0),
    "negative_target_size": (32, 16),
}


@pytest.mark.parametrize(
    ("names", "count"),
    [(("original_size", "crops_coords_top_left", "target_size"), 2), (tuple(MICRO), 1)],
    ids=["conditional", "with-negative"],
)
def test_sdxl_micro_conditioning_matches_diffusers(xl, names, count):
    """Non-default original size, crop and target size (and the negative branch's own) enter
    ``time_ids`` as diffusers' ``__call__`` arguments do; the render changes with them.

    The negative case renders one prompt: diffusers 0.42 builds ``time_ids`` for B prompts as
    ``cat([negative, positive]).repeat(B, 1)``, which for B > 1 gives the first B CFG rows
    (the negative branch) alternating negative/positive ids and the positive branch the same;
    ours gives every negative row the negative ids (what one prompt per call gets there)."""
    micro = {name: MICRO[name] for name in names}
    ours, reference = _render(xl, steps=2, guidance=5.0, micro=micro, count=count)
    _close(ours, reference)
    plain, _ = _render(xl, steps=2, guidance=5.0, reference=False, count=count)
    assert np.abs(ours - plain).max() > 1e-3


def test_sdxl_micro_conditioning_rows_and_refusals(xl, sd):
    ours_pipe, _ = xl
    guidance = ours_pipe.guidance(5.0)
    cond, uncond, _ = ours_pipe.conditioning(
        PROMPTS,
        NEGATIVE,
        [guidance] * 2,
        77,
        size=(16, 24, 1),
        micro_conditioning=[MICRO, {"crops_coords_top_left": (1, 2)}],
    )
    np.testing.assert_array_equal(
        cond["time_ids"], [[64, 96, 8, 4, 24, 40], [16, 24, 1, 2, 16, 24]]
    )
    np.testing.assert_array_equal(
        uncond["time_ids"], [[12, 12, 2, 0, 32, 16], [16, 24, 1, 2, 16, 24]]
    )
    lone = {"negative_crops_coords_top_left": (2, 0)}
    with pytest.raises(families.FamilyError, match="needs both negative_original_size"):
        ours_pipe.conditioning(
            ["x"], ["y"], [guidance], 77, size=(16, 16, 1), micro_conditioning=[lone]
        )
    sd_pipe, _ = sd
    with pytest.raises(families.FamilyError, match="micro-conditioning; the sd family"):
        sd_pipe.conditioning(
            ["x"], ["y"], [sd_pipe.guidance(7.5)], 77, micro_conditioning=[{"target_size": (8, 8)}]
        )


def test_euler_ancestral_with_our_noise_matches_diffusers(xl):
    """diffusers draws the per-step noise from a torch generator; here it is handed ours (what
    ``seeds`` give), so the ancestral step itself is compared."""
    ours_pipe, _ = xl
    steps = 3
    shape = (len(SEEDS), *ours_pipe.latent_shape(16, 16, 1))
    noise = classic.step_noise(SEEDS, steps, shape[1:])
    ours, reference = _render(
        xl,
        scheduler="euler_ancestral",
        torch_scheduler="EulerAncestralDiscreteScheduler",
        steps=steps,
        guidance=5.0,
        seeds=list(SEEDS),
        torch_noise=noise,
    )
    _close(ours, reference)


@pytest.mark.slow  # compiles the loop for two batch sizes
def test_euler_ancestral_is_per_prompt_deterministic(xl):
    """A row's render depends on its own seed alone (not on the batch it is in)."""
    ours_pipe, _ = xl
    shape = ours_pipe.latent_shape(16, 16, 1)
    guidance = ours_pipe.guidance(5.0)

    def render(prompts, seeds, step_seeds="same"):
        cond, uncond, scales = ours_pipe.conditioning(
            prompts, [""] * len(prompts), [guidance] * len(prompts), 77, size=(16, 16, 1)
        )
        latents = np.stack([initial_latents(seed, shape) for seed in seeds])
        return np.asarray(
            ours_pipe.sample(
                latents,
                cond,
                uncond,
                num_inference_steps=2,
                cfg_scale=scales,
                scheduler="euler_ancestral",
                seeds=seeds if step_seeds == "same" else step_seeds,
            )
        )

    pair = render(PROMPTS, [3, 4])
    alone = render(PROMPTS[1:], [4])
    # latents of magnitude ~14: batch size changes XLA's float32 rounding by ~1e-6 relative
    np.testing.assert_allclose(pair[1], alone[0], atol=1e-4, rtol=0)
    with pytest.raises(families.FamilyError, match="seeds"):
        render(PROMPTS[1:], [4], step_seeds=None)


# --- errors and configs -------------------------------------------------------------------------


def test_refusals_are_named(sd):
    ours, _ = sd
    with pytest.raises(families.FamilyError, match="true_cfg_scale"):
        ours.guidance(7.5, true_cfg_scale=2.0)
    with pytest.raises(families.FamilyError, match="flow_shift"):
        ours.family.make_schedule(ours, "ddim", 2, 3.0, (1, 4, 8, 8))
    with pytest.raises(families.FamilyError, match="unipc"):
        ours.family.make_schedule(ours, "unipc", 2, 1.0, (1, 4, 8, 8))
    with pytest.raises(ValueError, match="height must be a positive multiple of 8"):
        ours.geometry.check(12, 16, 1)


def test_flux_and_wan_refuse_guidance_rescale_and_micro_conditioning():
    for name in ("flux", "wan"):
        family = families.get(name)
        with pytest.raises(families.FamilyError, match="guidance_rescale"):
            family.with_guidance_rescale({}, families.Guidance(), 0.7)
        with pytest.raises(families.FamilyError, match=r"\['target_size'\]: SDXL"):
            family.size_conditioning({}, 16, 16, [{}, {"target_size": (8, 8)}])
        assert family.size_conditioning({}, 16, 16, [{}, {}]) == ({}, {})


REAL = {
    # name: (unet params, text encoder params, text_encoder_2 params, vae params, size, steps)
    "sd2_base": (865_910_724, 340_387_840, None, 83_653_863, 512, "epsilon"),
    "sd2.1": (865_910_724, 340_387_840, None, 83_653_863, 768, "v_prediction"),
    "sdxl_base": (2_567_463_684, 123_060_480, 694_659_840, 83_653_863, 1024, "epsilon"),
}


@pytest.mark.parametrize(
    "name",
    ["sd2_base", "sd2.1", pytest.param("sdxl_base", marks=pytest.mark.slow)],  # SDXL: ~7 s
)
def test_real_sd_configs_count_like_diffusers(name):
    from jaxcore.model_configs import read_model_yaml
    from jaxcore.models import autoencoder_kl, clip_text

    unet_params, te_params, te2_params, vae_params, size, _ = REAL[name]
    family, configs = read_model_yaml(REPO / f"configs/models/{name}.yml")
    assert family.name == "sd"
    assert unet.count_params(configs["unet"]) == unet_params
    assert clip_text.count_params(configs["text_encoder"]) == te_params
    if te2_params is not None:
        assert clip_text.count_params(configs["text_encoder_2"], with_projection=True) == te2_params
    assert autoencoder_kl.count_params(configs["vae"]) == vae_params
    assert family.geometry(configs).spatial_multiple == 8
    assert family.latent_shape(configs, size, size, 1) == (4, size // 8, size // 8)
    defaults = family.sampling_defaults(configs)
    assert (defaults["height"], defaults["num_inference_steps"]) == (size, 50)


def test_scan_layers_is_refused_for_the_unet_by_name():
    """compute.scan_layers scans equal transformer blocks (Wan, Flux); the UNet has none, and
    saying so beats silently running it unrolled."""
    from jaxcore.compute import ComputeConfig

    family = families.get("sd")
    with pytest.raises(families.FamilyError, match="compute.scan_layers"):
        family.make_denoiser(None, ComputeConfig(scan_layers=True))
