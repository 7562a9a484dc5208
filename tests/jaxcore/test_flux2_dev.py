"""The flux2_dev family (FLUX.2 [dev]) vs diffusers ``Flux2Pipeline``.

configs/models/flux2_dev.yml builds the released architecture: each component, built by
diffusers / transformers from the YAML's section on the meta device, counts the parameters ours
counts from abstract shapes, and those are the released model's counts.

The renders: a tiny random-init pipeline (tests/support/tiny_flux2_dev.py: every weight
perturbed, the latent BatchNorm statistics away from 0 / 1, a 30-layer Mistral-3 with a
chat-template tokenizer, a transformer with a guidance embedder) written as a folder that our
loader reads; diffusers' ``Flux2Pipeline`` is built from the same folder's components with a
stand-in for the ``PixtralProcessor`` (see that module). Both render the same prompts from the
same initial latents at an odd non-square size (20 x 36 pixels: 5 x 9 tokens). Asserted: max
|diff| <= 1e-4 on [0, 1] pixels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxcore import families
from jaxcore.compute import ComputeConfig
from jaxcore.config import ConfigError
from jaxcore.families import flux2_dev, load_pipeline
from jaxcore.model_configs import read_model_yaml
from jaxcore.models import autoencoder_kl_flux2 as flux2_vae
from jaxcore.models import flux2_transformer as f2
from jaxcore.models import mistral3
from jaxcore.sampling import initial_latents
from tests.jaxcore.test_flux2_configs import VAE_PARAMS
from tests.jaxcore.test_flux2_transformer import RELEASED_COUNTS
from tests.jaxcore.test_mistral3 import MISTRAL_SMALL_3_TEXT
from tests.jaxcore.test_mistral3 import REAL_COUNTS as MISTRAL_COUNTS
from tests.support.tiny_flux2_dev import build_flux2_dev_pipeline, reference_pipeline

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
PROMPTS = ["a red fox in the snow", "blue square"]
HEIGHT, WIDTH = 20, 36
STEPS = 3
LENGTH = 32  # max_sequence_length
OTHER_LAYERS = (4, 17, 30)  # non-default text_encoder_out_layers (30: the final-normed one)


def _meta_count(module) -> int:
    """Parameters of a module built on the meta device (nothing allocated)."""
    return sum(p.numel() for p in module.parameters())


def test_yaml_counts_like_diffusers():
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import MistralConfig, MistralModel

    family, configs = read_model_yaml(REPO / "configs/models/flux2_dev.yml")
    assert family.name == "flux2_dev"
    transformer, vae, encoder = configs["transformer"], configs["vae"], configs["text_encoder"]
    with torch.device("meta"):
        torch_transformer = Flux2Transformer2DModel(**transformer.to_dict())
        torch_vae = AutoencoderKLFlux2(**vae.to_dict())
        torch_encoder = MistralModel(MistralConfig(**encoder.to_dict()))
        default_transformer = Flux2Transformer2DModel()  # the YAML is diffusers' defaults
    assert f2.count_params(transformer) == _meta_count(torch_transformer) == RELEASED_COUNTS["dev"]
    assert _meta_count(default_transformer) == RELEASED_COUNTS["dev"]
    assert flux2_vae.count_params(vae) == _meta_count(torch_vae) == VAE_PARAMS
    assert mistral3.count_params(encoder) == _meta_count(torch_encoder) == MISTRAL_COUNTS[0]
    assert encoder == mistral3.MistralTextConfig.from_dict(MISTRAL_SMALL_3_TEXT)
    assert configs["pipeline"].text_encoder_out_layers == (10, 20, 30)

    # 1024 x 1024 -> 64 x 64 tokens of 128 channels; Flux2Pipeline.__call__'s defaults
    assert family.latent_shape(configs, 1024, 1024, 1) == (128, 64, 64)
    defaults = family.sampling_defaults(configs)
    assert (defaults["height"], defaults["width"], defaults["num_inference_steps"]) == (
        1024,
        1024,
        50,
    )
    assert (defaults["guidance_scale"], defaults["max_sequence_length"]) == (4.0, 512)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny Flux2Pipeline folder, built once."""
    return build_flux2_dev_pipeline(tmp_path_factory.mktemp("flux2_dev"), seed=1)


@pytest.fixture(scope="module")
def dev(folder):
    """(our Pipeline, diffusers' Flux2Pipeline) of the folder."""
    return load_pipeline(folder), reference_pipeline(folder)


def _images():
    """Two random RGB reference images, 70 x 90 and 100 x 66 (cropped to 68 x 88, 100 x 64)."""
    import PIL.Image

    rng = np.random.default_rng(7)
    return [
        PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for w, h in ((70, 90), (100, 66))
    ]


def _ours(pipe, *, guidance, references=None):
    """Our Pipeline API's render [B, H, W, 3] from the seeds 3, 4 latents (and the latents)."""
    shape = pipe.latent_shape(HEIGHT, WIDTH, 1)
    latents = np.stack([initial_latents(seed, shape) for seed in (3, 4)])
    images = None if references is None else [(list(references), None)] * len(PROMPTS)
    cond, uncond, scales = pipe.conditioning(
        PROMPTS,
        [""] * len(PROMPTS),
        [pipe.guidance(guidance)] * len(PROMPTS),
        LENGTH,
        images=images,
        size=(HEIGHT, WIDTH, 1),
    )
    assert uncond is None  # no CFG: no negative branch
    z = pipe.sample(latents, cond, uncond, num_inference_steps=STEPS, cfg_scale=scales)
    return np.asarray(pipe.decode(z))[:, 0], latents


def _theirs(pipe, latents, *, guidance, references=None, **kwargs):
    """diffusers' render [B, H, W, 3] from the same latents."""
    return pipe(
        image=None if references is None else list(references),
        prompt=PROMPTS,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        latents=torch.from_numpy(latents),
        max_sequence_length=LENGTH,
        output_type="np",
        **kwargs,
    ).images


def _assert_equal(ours, theirs):
    """Same shape, a non-flat reference, and equal within TOLERANCE."""
    assert ours.shape == theirs.shape == (len(PROMPTS), HEIGHT, WIDTH, 3)
    assert theirs.std() > 0.05  # not a flat (saturated) image
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0)


def test_loads_as_the_flux2_dev_family(dev):
    """Recognised from model_index.json, with the dev shapes, embedded guidance and defaults."""
    ours, _ = dev
    assert ours.family.name == "flux2_dev" and ours.default_scheduler == "flow_euler"
    assert ours.latent_shape(HEIGHT, WIDTH, 1) == (24, 5, 9)  # 4 x 6 latent channels
    guidance = ours.guidance(4.0)
    assert guidance.cfg_scale == 1.0 and dict(guidance.embedded) == {"guidance": 4.0}
    assert ours.configs["pipeline"].text_encoder_out_layers == (10, 20, 30)
    defaults = ours.family.sampling_defaults(ours.configs)
    assert (defaults["height"], defaults["num_inference_steps"]) == (256, 50)
    assert defaults["guidance_scale"] == 4.0 and defaults["max_sequence_length"] == 512


@pytest.mark.parametrize("scale", [2.5, 4.0])
def test_text_to_image_matches_diffusers(dev, scale):
    """The embedded guidance at 2.5 and at 4 (diffusers' default); the scale matters."""
    ours, latents = _ours(dev[0], guidance=scale)
    theirs = _theirs(dev[1], latents, guidance=scale)
    _assert_equal(ours, theirs)
    other = _theirs(dev[1], latents, guidance=6.5 - scale)  # the other scale
    assert np.abs(other - theirs).max() > 1e-3


def test_other_text_encoder_out_layers_match_diffusers(folder, dev):
    """text_encoder_out_layers as a load_pipeline option vs diffusers' __call__ argument."""
    ours_pipe = load_pipeline(folder, text_encoder_out_layers=OTHER_LAYERS)
    assert ours_pipe.configs["pipeline"].text_encoder_out_layers == OTHER_LAYERS
    ours, latents = _ours(ours_pipe, guidance=4.0)
    theirs = _theirs(dev[1], latents, guidance=4.0, text_encoder_out_layers=OTHER_LAYERS)
    _assert_equal(ours, theirs)
    default, _ = _ours(dev[0], guidance=4.0)
    assert np.abs(default - ours).max() > 1e-3  # the layers matter


@pytest.mark.parametrize("count", [1, 2], ids=["one-reference", "two-references"])
def test_editing_with_reference_images_matches_diffusers(dev, count):
    """1 or 2 reference images (other sizes than the output's) per prompt."""
    references = _images()[:count]
    ours, latents = _ours(dev[0], guidance=4.0, references=references)
    _assert_equal(ours, _theirs(dev[1], latents, guidance=4.0, references=references))
    plain, _ = _ours(dev[0], guidance=4.0)
    assert np.abs(plain - ours).max() > 1e-3  # the references matter


def test_convert_encoders_match_the_pipeline(folder, dev):
    """convert's encoders: captions as Flux2Pipeline.encode_prompt embeds them."""
    encoders = dev[0].family.load_encoders(folder, ComputeConfig(), LENGTH, batch_size=2)
    ours = encoders.encode_text(PROMPTS[:1])[flux2_dev.flux2.TEXT]
    with torch.no_grad():
        theirs, _ = dev[1].encode_prompt(PROMPTS[:1], max_sequence_length=LENGTH)
    assert ours.shape == tuple(theirs.shape) == (1, LENGTH, 96) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-5 * np.abs(ours).max(), rtol=0)


def test_refusals_name_the_setting(folder, dev, tmp_path):
    """What the family cannot do is an error naming the setting, before anything runs."""
    ours, _ = dev
    with pytest.raises(families.FamilyError, match="true_cfg_scale"):
        ours.guidance(4.0, true_cfg_scale=2.0)
    with pytest.raises(families.FamilyError, match="guidance_scale_2"):
        ours.guidance(4.0, guidance_scale_2=2.0)
    for option, value in (("caption_upsample_temperature", 0.15), ("reference_kv", True)):
        with pytest.raises(families.FamilyError, match=option):
            load_pipeline(folder, **{option: value})
    with pytest.raises(families.FamilyError, match="joint_attention_dim"):
        load_pipeline(folder, text_encoder_out_layers=(10, 20))
    with pytest.raises(families.FamilyError, match=r"0\.\.30"):
        load_pipeline(folder, text_encoder_out_layers=(10, 20, 31))
    index = json.loads((folder / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(json.dumps({**index, "is_distilled": True}))
    with pytest.raises(families.FamilyError, match="is_distilled"):
        families.for_pipeline(tmp_path)
    yaml = (REPO / "configs/models/flux2_dev.yml").read_text()
    for old, new, message in (
        ("guidance_embeds: true", "guidance_embeds: false", "guidance_embeds=false"),
        ("pipeline:\n", "pipeline:\n  caption_upsample_temperature: 0.15\n", "caption_upsample"),
    ):
        path = tmp_path / "dev.yml"
        path.write_text(yaml.replace(old, new))
        with pytest.raises(ConfigError, match=message):
            read_model_yaml(path)
