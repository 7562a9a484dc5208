"""The flux2 family's Pipeline API vs diffusers ``Flux2KleinPipeline`` on a tiny random-init
pipeline (tests/support/tiny_flux2.py: every weight perturbed, the latent BatchNorm statistics
away from 0 / 1, a 28-layer Qwen3 with a chat-template tokenizer), saved with
``save_pretrained`` and loaded by both from the folder.

Both render the same prompts from the same initial latents (diffusers takes the patchified
``[B, 4c, h, w]`` latents and packs them itself) at an odd non-square size (20 x 36 pixels:
5 x 9 tokens). Asserted: max |diff| <= 1e-4 on [0, 1] pixels; reached ~5e-6 (CFG, distilled,
other out layers, one and two reference images of other sizes than the output's).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcore import families
from jaxcore.families import flux2, load_pipeline
from jaxcore.sampling import initial_latents
from tests.support.tiny_flux2 import build_flux2_pipeline, distilled_copy

TOLERANCE = 1e-4
PROMPTS = ["a red fox in the snow", "blue square"]
HEIGHT, WIDTH = 20, 36
STEPS = 3
LENGTH = 32  # max_sequence_length
OTHER_LAYERS = (5, 12, 28)  # non-default text_encoder_out_layers (28: the final-normed one)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny non-distilled pipeline folder, built once."""
    return build_flux2_pipeline(tmp_path_factory.mktemp("flux2_klein"), seed=1)


@pytest.fixture(scope="module")
def klein(folder):
    """(our Pipeline, diffusers' Flux2KleinPipeline) of the folder."""
    from diffusers import Flux2KleinPipeline

    return load_pipeline(folder), Flux2KleinPipeline.from_pretrained(folder)


def _images():
    """Two random RGB reference images, 70 x 90 and 100 x 66 (cropped to 68 x 88, 100 x 64)."""
    import PIL.Image

    rng = np.random.default_rng(7)
    return [
        PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for w, h in ((70, 90), (100, 66))
    ]


def _ours(pipe, *, guidance, negatives=None, references=None):
    """Our Pipeline API's render [B, H, W, 3] from the seeds 3, 4 latents (and the latents)."""
    shape = pipe.latent_shape(HEIGHT, WIDTH, 1)
    latents = np.stack([initial_latents(seed, shape) for seed in (3, 4)])
    images = None if references is None else [(list(references), None)] * len(PROMPTS)
    cond, uncond, scales = pipe.conditioning(
        PROMPTS,
        negatives or [""] * len(PROMPTS),
        [pipe.guidance(guidance)] * len(PROMPTS),
        LENGTH,
        images=images,
        size=(HEIGHT, WIDTH, 1),
    )
    z = pipe.sample(latents, cond, uncond, num_inference_steps=STEPS, cfg_scale=scales)
    return np.asarray(pipe.decode(z))[:, 0], latents


def _theirs(pipe, latents, *, guidance, references=None, **kwargs):
    """diffusers' render [B, H, W, 3] from the same latents."""
    import torch

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


def test_loads_as_the_flux2_family(klein):
    """Recognised from model_index.json, with Klein's shapes, guidance and defaults."""
    ours, _ = klein
    assert ours.family.name == "flux2" and ours.default_scheduler == "flow_euler"
    assert ours.latent_shape(HEIGHT, WIDTH, 1) == (24, 5, 9)  # 4 x 6 latent channels
    assert (ours.geometry.spatial_multiple, ours.geometry.temporal_multiple) == (4, 0)
    assert ours.guidance(4.0).cfg_scale == 4.0 and ours.guidance(1.0).uses_cfg is False
    assert ours.configs["pipeline"].text_encoder_out_layers == (9, 18, 27)
    defaults = ours.family.sampling_defaults(ours.configs)
    assert (defaults["height"], defaults["num_inference_steps"]) == (256, 50)
    assert defaults["guidance_scale"] == 4.0 and defaults["max_sequence_length"] == 512


def test_text_to_image_with_cfg_matches_diffusers(klein):
    """CFG at guidance 4 with diffusers' negative, the empty prompt."""
    ours, latents = _ours(klein[0], guidance=4.0)
    _assert_equal(ours, _theirs(klein[1], latents, guidance=4.0))


def test_a_negative_prompt_is_encoded_as_the_negative(klein):
    """diffusers takes other negatives only as embeddings: its own encoding of them."""
    negatives = ["", "dark background"]
    ours, latents = _ours(klein[0], guidance=3.0, negatives=negatives)
    embeds, _ = klein[1].encode_prompt(negatives, max_sequence_length=LENGTH)
    theirs = _theirs(klein[1], latents, guidance=3.0, negative_prompt_embeds=embeds)
    _assert_equal(ours, theirs)
    default, _ = _ours(klein[0], guidance=3.0)
    assert np.abs(default[0] - ours[0]).max() < 1e-6  # "" is the default negative
    assert np.abs(default[1] - ours[1]).max() > 1e-3


def test_distilled_pipeline_has_no_cfg(folder, tmp_path):
    """model_index.json's is_distilled turns CFG off whatever the guidance_scale."""
    from diffusers import Flux2KleinPipeline

    distilled = distilled_copy(folder, tmp_path / "distilled")
    ours_pipe = load_pipeline(distilled)
    assert ours_pipe.configs["pipeline"].is_distilled
    assert not ours_pipe.guidance(4.0).uses_cfg  # guidance_scale ignored, as diffusers does
    ours, latents = _ours(ours_pipe, guidance=4.0)
    theirs = _theirs(Flux2KleinPipeline.from_pretrained(distilled), latents, guidance=4.0)
    _assert_equal(ours, theirs)


def test_other_text_encoder_out_layers_match_diffusers(folder, klein):
    """text_encoder_out_layers as a load_pipeline option vs diffusers' __call__ argument."""
    ours_pipe = load_pipeline(folder, text_encoder_out_layers=OTHER_LAYERS)
    assert ours_pipe.configs["pipeline"].text_encoder_out_layers == OTHER_LAYERS
    ours, latents = _ours(ours_pipe, guidance=4.0)
    theirs = _theirs(klein[1], latents, guidance=4.0, text_encoder_out_layers=OTHER_LAYERS)
    _assert_equal(ours, theirs)
    default, _ = _ours(klein[0], guidance=4.0)
    assert np.abs(default - ours).max() > 1e-3  # the layers matter


@pytest.mark.parametrize("count", [1, 2], ids=["one-reference", "two-references"])
def test_editing_with_reference_images_matches_diffusers(klein, count):
    """1 or 2 reference images (other sizes than the output's) per prompt."""
    references = _images()[:count]
    ours, latents = _ours(klein[0], guidance=4.0, references=references)
    _assert_equal(ours, _theirs(klein[1], latents, guidance=4.0, references=references))
    plain, _ = _ours(klein[0], guidance=4.0)
    assert np.abs(plain - ours).max() > 1e-3  # the references matter


def test_reference_preprocessing_matches_the_pipeline(klein):
    """A reference larger than 1024 x 1024 pixels of area (LANCZOS down to it, then cropped),
    and an RGBA one, against the pipeline's own lines (its __call__ step 4)."""
    import PIL.Image

    processor = klein[1].image_processor
    multiple = klein[1].vae_scale_factor * 2
    rng = np.random.default_rng(3)
    large = PIL.Image.fromarray(rng.integers(0, 256, (1001, 1111, 3), dtype=np.uint8))
    rgba = PIL.Image.fromarray(rng.integers(0, 256, (67, 95, 4), dtype=np.uint8))
    for image in (large, rgba):
        width, height = image.size
        if width * height > 1024 * 1024:
            image_for_them = processor._resize_to_target_area(image, 1024 * 1024)
            width, height = image_for_them.size
        else:
            image_for_them = image
        width, height = (width // multiple) * multiple, (height // multiple) * multiple
        theirs = processor.preprocess(
            image_for_them, height=height, width=width, resize_mode="crop"
        )
        ours = flux2.preprocess_reference(image, multiple)
        np.testing.assert_allclose(ours, theirs[0].numpy(), atol=1e-6, rtol=0)


def test_refusals_name_the_setting(folder, klein):
    """What the family cannot do is an error naming the setting, before anything runs."""
    ours, _ = klein
    with pytest.raises(families.FamilyError, match="true_cfg_scale"):
        ours.guidance(4.0, true_cfg_scale=2.0)
    images = _images()
    with pytest.raises(families.FamilyError, match="last_image"):
        ours.family.encode_images(ours, [(images[0], images[1])], HEIGHT, WIDTH, 1)
    with pytest.raises(families.FamilyError, match="mix"):
        ours.family.encode_images(ours, [(images[0], None), (None, None)], HEIGHT, WIDTH, 1)
    with pytest.raises(families.FamilyError, match="same number"):
        ours.family.encode_images(ours, [(images[0], None), (images[1], None)], HEIGHT, WIDTH, 1)
    with pytest.raises(families.FamilyError, match="at most 4"):
        ours.family.encode_images(ours, [(images * 3, None)], HEIGHT, WIDTH, 1)
    with pytest.raises(families.FamilyError, match="joint_attention_dim"):
        load_pipeline(folder, text_encoder_out_layers=(9, 18))
    with pytest.raises(families.FamilyError, match="0..28"):
        load_pipeline(folder, text_encoder_out_layers=(9, 18, 29))
