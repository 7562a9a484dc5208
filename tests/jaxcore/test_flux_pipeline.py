"""The Flux family's pipeline vs diffusers ``FluxPipeline`` on tiny random-init pipelines.

The pipelines are built with diffusers/transformers (every weight perturbed) and saved with
``save_pretrained`` (tests/support/tiny_flux.py); diffusers renders from the saved directory,
as a user of it would. Both render the same prompts from the same initial latents (diffusers
takes them packed). Asserted: max |diff| <= 1e-4 on [0, 1] pixels; reached 3.3e-6 (dev, square),
3.9e-6 (non-square, 24-token text), 2.0e-6 (true CFG), 7.1e-7 (schnell).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxcore import families
from jaxcore.families import load_pipeline
from jaxcore.models import flux_transformer
from jaxcore.sampling import initial_latents
from tests.support.tiny_flux import SCHNELL_SCHEDULER, build_flux_pipeline

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
PROMPTS = ["a red circle on a white background", "blue square"]
NEGATIVE = ["dark background", "green"]


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory):
    return build_flux_pipeline(tmp_path_factory.mktemp("flux_dev"), seed=1)


@pytest.fixture(scope="module")
def schnell_dir(tmp_path_factory):
    return build_flux_pipeline(
        tmp_path_factory.mktemp("flux_schnell"),
        seed=2,
        guidance_embeds=False,
        scheduler=SCHNELL_SCHEDULER,
    )


@pytest.fixture(scope="module")
def dev(dev_dir):
    from diffusers import FluxPipeline

    return load_pipeline(dev_dir), FluxPipeline.from_pretrained(dev_dir)


@pytest.fixture(scope="module")
def schnell(schnell_dir):
    from diffusers import FluxPipeline

    return load_pipeline(schnell_dir), FluxPipeline.from_pretrained(schnell_dir)


def _render(pipes, *, height, width, steps, guidance, true_cfg=1.0, negative=None, length=32):
    """(ours [B, H, W, 3], diffusers' [B, H, W, 3]) from the same per-prompt latents."""
    import torch

    ours_pipe, torch_pipe = pipes
    shape = ours_pipe.latent_shape(height, width, 1)
    latents = np.stack([initial_latents(seed, shape) for seed in (3, 4)])
    guidances = [ours_pipe.guidance(guidance, true_cfg)] * len(PROMPTS)
    negatives = negative or [""] * len(PROMPTS)
    cond, uncond, scales = ours_pipe.conditioning(PROMPTS, negatives, guidances, length)
    z = ours_pipe.sample(latents, cond, uncond, num_inference_steps=steps, cfg_scale=scales)
    ours = np.asarray(ours_pipe.decode(z))[:, 0]
    packed = np.asarray(flux_transformer.pack_latents(latents))
    reference = torch_pipe(
        prompt=PROMPTS,
        negative_prompt=negative,
        true_cfg_scale=true_cfg,
        guidance_scale=guidance,
        height=height,
        width=width,
        num_inference_steps=steps,
        latents=torch.from_numpy(packed),
        max_sequence_length=length,
        output_type="np",
    ).images
    return ours, reference


def test_loads_as_the_flux_family(dev):
    ours, _ = dev
    assert ours.family.name == "flux" and ours.default_scheduler == "flow_euler"
    assert ours.latent_shape(16, 24, 1) == (4, 8, 12)
    assert (ours.geometry.spatial_multiple, ours.geometry.temporal_multiple) == (4, 0)
    assert ours.guidance(3.5).embedded == {"guidance": 3.5} and not ours.guidance(3.5).uses_cfg


@pytest.mark.parametrize(
    ("height", "width", "steps", "length"),
    [(16, 16, 3, 32), (16, 24, 2, 24)],
    ids=["square", "non-square-short-text"],
)
def test_dev_embedded_guidance_matches_diffusers(dev, height, width, steps, length):
    ours, reference = _render(
        dev, height=height, width=width, steps=steps, guidance=3.5, length=length
    )
    assert ours.shape == reference.shape == (2, height, width, 3)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_dev_true_cfg_matches_diffusers(dev):
    ours, reference = _render(
        dev, height=16, width=16, steps=3, guidance=2.0, true_cfg=4.0, negative=NEGATIVE
    )
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_schnell_without_guidance_embedding_matches_diffusers(schnell):
    ours_pipe, _ = schnell
    assert ours_pipe.guidance(0.0).embedded == {}
    ours, reference = _render(schnell, height=16, width=16, steps=2, guidance=0.0)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_guidance_true_cfg_and_text_length_change_the_render(dev):
    """The parity tests would pass vacuously if nothing depended on these settings."""
    base, _ = _render(dev, height=16, width=16, steps=2, guidance=3.5)
    other_guidance, _ = _render(dev, height=16, width=16, steps=2, guidance=1.0)
    cfg, _ = _render(
        dev, height=16, width=16, steps=2, guidance=3.5, true_cfg=4.0, negative=NEGATIVE
    )
    shorter, _ = _render(dev, height=16, width=16, steps=2, guidance=3.5, length=16)
    for other in (other_guidance, cfg, shorter):
        assert np.abs(base - other).max() > 1e-3
    assert np.abs(base[0] - base[1]).max() > 1e-3  # the prompt matters


def test_dynamic_shift_refuses_a_flow_shift(dev):
    ours, _ = dev
    shape = ours.latent_shape(16, 16, 1)
    cond = ours.encode_prompts(PROMPTS[:1], 16)
    cond["guidance"] = np.array([3.5], np.float32)
    with pytest.raises(families.FamilyError, match="use_dynamic_shifting"):
        ours.sample(initial_latents(0, shape)[None], cond, num_inference_steps=2, shift=5.0)


def test_real_flux_configs_count_like_diffusers():
    from jaxcore.model_configs import read_model_yaml
    from jaxcore.models import autoencoder_kl, clip_text, t5

    for name, transformer_params in (
        ("flux1_dev", 11_901_408_320),
        ("flux1_schnell", 11_891_178_560),
    ):
        family, configs = read_model_yaml(REPO / f"configs/models/{name}.yml")
        assert family.name == "flux"
        assert flux_transformer.count_params(configs["transformer"]) == transformer_params
        assert autoencoder_kl.count_params(configs["vae"]) == 83_819_683
        assert clip_text.count_params(configs["text_encoder"]) == 123_060_480
        assert t5.count_params(configs["text_encoder_2"]) == 4_762_310_656
        assert family.geometry(configs).spatial_multiple == 16
        assert family.latent_shape(configs, 1024, 1024, 1) == (16, 128, 128)
        defaults = family.sampling_defaults(configs)
        assert (defaults["height"], defaults["num_inference_steps"]) == (1024, 28)
