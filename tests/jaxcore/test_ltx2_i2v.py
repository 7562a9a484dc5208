"""The ``ltx2`` family's image-to-video vs diffusers' ``LTX2ImageToVideoPipeline.__call__`` (a
tiny random-init pipeline, every parameter perturbed, saved with save_pretrained; fp32 on CPU).

diffusers draws the video noise itself when it encodes the image (given ``latents`` skip the
image), so both sides start from the noise of one torch generator: diffusers draws it in
``prepare_latents`` (its only draw before the loop), the family takes the same numbers as the
prompts' ``latents`` (their first frame replaced by the image's). The audio latents are given
to both. Video pixels in [0, 1] and the waveform agree within 1e-4, without and with CFG, with
diffusers' default guidance (STG at block 28 perturbs nothing on 2 blocks) and with STG on a
block the model has, without re-compression (``image_crf=0``), at the default CRF 33 (PyAV's
libx264 frame is bit-equal to diffusers') and at a prompt's own ``image_crf``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from jaxcore import families
from jaxcore.families import ltx2, ltx2_image
from jaxcore.families.base import FamilyError
from tests.support import tiny_ltx2_i2v

PIXEL_TOLERANCE = 1e-4  # max abs on [0, 1] pixels
WAVE_TOLERANCE = 1e-4  # max abs on the waveform
HEIGHT = WIDTH = 32  # diffusers' check_inputs: multiples of 32
NUM_FRAMES = 9  # 3 latent frames; audio: 9 latent frames
STEPS = 3
MAX_SEQUENCE_LENGTH = 16
PROMPTS = ["a red fox in the snow", "a cat on a mat"]
NEGATIVES = ["", "a long prompt"]
IMAGE_SIZE = (40, 56)  # (height, width): not the render size, so the resize matters
GUIDANCE_KEYS = (
    "guidance_scale",
    "guidance_rescale",
    "audio_guidance_scale",
    "modality_scale",
    "stg_scale",
    "audio_stg_scale",
)
# name -> GUIDANCE_KEYS' values (the audio's None: the video's); "defaults": diffusers' own
GUIDANCE = {
    "no_cfg": (1.0, 0.0, None, 1.0, 0.0, 0.0),
    "cfg": (3.0, 0.0, None, 1.0, 0.0, 0.0),
    "defaults": None,
}


def _images(count: int) -> list:
    return [tiny_ltx2_i2v.conditioning_image(*IMAGE_SIZE, seed=i) for i in range(count)]


def _both(directory):
    from diffusers import LTX2ImageToVideoPipeline

    theirs = LTX2ImageToVideoPipeline.from_pretrained(directory, dtype=torch.float32)
    return theirs, families.load_pipeline(directory)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ltx2_i2v") / "pipe"
    return _both(tiny_ltx2_i2v.build_ltx2_i2v_pipeline(directory))


def _noise(pipe, seed: int):
    """diffusers' video noise (its generator's first draw, normalised space) and audio
    latents (normalised), as the family takes them."""
    shape = pipe.latent_shape(HEIGHT, WIDTH, NUM_FRAMES)
    joint = ltx2.layout(pipe.configs, shape[1:])
    batch = len(PROMPTS)
    generator = torch.Generator().manual_seed(seed)
    video = torch.randn((batch, joint.channels, *joint.grid), generator=generator).numpy()
    audio_vae = pipe.configs["audio_vae"]
    mel_bins = joint.audio_width // audio_vae.latent_channels
    rng = np.random.default_rng(seed)
    audio = rng.standard_normal(
        (batch, audio_vae.latent_channels, joint.audio_frames, mel_bins), np.float32
    )
    return video, audio, joint


def _denormalised_audio(theirs, audio):
    packed = theirs._pack_audio_latents(torch.from_numpy(audio))
    packed = packed * theirs.audio_vae.latents_std + theirs.audio_vae.latents_mean
    return theirs._unpack_audio_latents(packed, audio.shape[2], num_mel_bins=audio.shape[3])


def _guidance_kwargs(name: str) -> dict:
    values = GUIDANCE[name]
    return {} if values is None else dict(zip(GUIDANCE_KEYS, values, strict=True))


def _reference(theirs, images, audio, seed, guidance: dict, **options):
    image = images if len(images) > 1 else images[0]
    with torch.no_grad():
        frames, wave = theirs(
            image=image,
            prompt=PROMPTS,
            negative_prompt=NEGATIVES,
            height=HEIGHT,
            width=WIDTH,
            num_frames=NUM_FRAMES,
            frame_rate=ltx2.FRAME_RATE,
            num_inference_steps=STEPS,
            audio_latents=_denormalised_audio(theirs, audio),
            generator=torch.Generator().manual_seed(seed),
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            output_type="np",
            return_dict=False,
            **guidance,
            **options,
        )
    return np.asarray(frames, np.float32), wave.float().numpy()


def _settings(pipe, guidance: dict) -> tuple[float, float, dict]:
    """(guidance_scale, guidance_rescale, per-prompt settings): the family's defaults (diffusers'
    __call__ defaults) under the test's values."""
    defaults = pipe.family.sampling_defaults(pipe.configs)
    del defaults["image_crf"]  # the pipeline option's, unless a test's line sets one
    values = {**defaults, **guidance}
    settings = {k: values[k] for k in ltx2.SETTINGS if values.get(k) is not None}
    return values["guidance_scale"], values["guidance_rescale"], settings


def _ours(pipe, images, video, audio, joint, guidance: dict, crf: int):
    pipe.configs["pipeline"] = dataclasses.replace(pipe.configs["pipeline"], image_crf=crf)
    scale, rescale, settings = _settings(pipe, guidance)
    row = pipe.guidance(scale, guidance_rescale=rescale, settings=settings)
    rows = len(PROMPTS)
    cond, uncond, scales = pipe.conditioning(
        PROMPTS,
        NEGATIVES,
        [row] * rows,
        MAX_SEQUENCE_LENGTH,
        images=[(images[i % len(images)], None) for i in range(rows)],
        size=(HEIGHT, WIDTH, NUM_FRAMES),
        micro_conditioning=[settings] * rows,
    )
    result = pipe.sample(
        ltx2.joint_latents(video, audio, joint),
        cond,
        uncond,
        num_inference_steps=STEPS,
        cfg_scale=scales,
        guidance_rescale=[row.guidance_rescale] * rows,
    )
    frames = np.asarray(pipe.decode(result, cond))
    wave, _ = pipe.family.decode_audio(pipe, result, cond)
    return frames, wave, np.asarray(result)


def _errors(ours, theirs) -> tuple[float, float]:
    assert ours[0].shape == theirs[0].shape == (len(PROMPTS), NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert ours[1].shape == theirs[1].shape
    # not trivially equal: the render varies across pixels and samples
    assert theirs[0].std() > 1e-2 and theirs[1].std() > 1e-3
    return float(np.abs(ours[0] - theirs[0]).max()), float(np.abs(ours[1] - theirs[1]).max())


@pytest.mark.parametrize(
    "name", ["cfg", pytest.param("no_cfg", marks=pytest.mark.slow), "defaults"]
)
def test_render_equals_diffusers_without_recompression(pipelines, name):
    """image_crf=0 on both sides: the image resized, encoded, held as the first frame, the
    per-token timesteps, the guidance (CFG, modality, rescale) and the stepping of the frames
    after the first; the image's frame is kept exactly through the loop."""
    theirs, pipe = pipelines
    images = _images(len(PROMPTS))
    video, audio, joint = _noise(pipe, seed=1)
    guidance = _guidance_kwargs(name)
    want = _reference(theirs, images, audio, 1, guidance, image_crf=0)
    frames, wave, latents = _ours(pipe, images, video, audio, joint, guidance, crf=0)
    pixel_error, wave_error = _errors((frames, wave), want)
    print(f"{name}: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE and wave_error < WAVE_TOLERANCE
    # the loop's first latent frame is the image's latent frame, bit for bit
    vae, params = pipe.components["vae"]
    first = ltx2_image.image_latents(vae, params, images, HEIGHT, WIDTH, crf=0)
    np.testing.assert_array_equal(latents[:, : joint.channels, :1], first)


def test_a_lines_image_crf_renders_as_diffusers(pipelines):
    """A prompt's ``image_crf`` (18) over the pipeline option (0): diffusers' ``image_crf=18``."""
    theirs, pipe = pipelines
    images = _images(1)
    video, audio, joint = _noise(pipe, seed=2)
    guidance = _guidance_kwargs("cfg")
    want = _reference(theirs, images, audio, 2, guidance, image_crf=18)
    line = {**guidance, "image_crf": 18}
    frames, wave, _ = _ours(pipe, images, video, audio, joint, line, crf=0)
    pixel_error, wave_error = _errors((frames, wave), want)
    print(f"a line's CRF 18: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE and wave_error < WAVE_TOLERANCE


def test_rows_of_a_batch_take_their_own_crf(pipelines, monkeypatch):
    """Each row's image at its own ``image_crf`` (else the pipeline option's): the latent
    frames of one call equal those encoded a CRF at a time; a CRF out of range is refused."""
    _, pipe = pipelines
    option = dataclasses.replace(pipe.configs["pipeline"], image_crf=51)
    monkeypatch.setitem(pipe.configs, "pipeline", option)
    images = [(_images(1)[0], None)] * 3  # one image: the rows differ by their CRF alone
    rows = [{"image_crf": 18}, {"image_crf": 0}, {}]
    got = pipe.family.encode_images(pipe, images, HEIGHT, WIDTH, NUM_FRAMES, rows)
    got = got[ltx2_image.IMAGE_LATENTS]
    vae, params = pipe.components["vae"]
    for row, crf in enumerate((18, 0, 51)):
        one = ltx2_image.image_latents(vae, params, [images[row][0]], HEIGHT, WIDTH, crf)
        np.testing.assert_array_equal(got[row], one[0])
    assert np.abs(got[0] - got[1]).max() > 0  # not trivially equal: the CRF matters
    with pytest.raises(FamilyError, match="image_crf"):
        pipe.family.encode_images(pipe, images[:1], HEIGHT, WIDTH, NUM_FRAMES, [{"image_crf": 52}])


def test_default_crf_render_equals_diffusers(pipelines):
    """diffusers' default re-compression (CRF 33 for a Gemma-3 pipeline, one image for both
    prompts) against the family's default, and the re-compression changes the render."""
    theirs, pipe = pipelines
    images = _images(1)
    video, audio, joint = _noise(pipe, seed=2)
    guidance = _guidance_kwargs("cfg")
    want = _reference(theirs, images, audio, 2, guidance)
    frames, wave, _ = _ours(pipe, images, video, audio, joint, guidance, crf=None)
    pixel_error, wave_error = _errors((frames, wave), want)
    print(f"default CRF: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE and wave_error < WAVE_TOLERANCE
    plain = _reference(theirs, images, audio, 2, guidance, image_crf=0)
    changed = np.abs(want[0] - plain[0]).max()
    print(f"CRF 33 changes diffusers' render by {changed:.2e}")
    assert changed > 10 * PIXEL_TOLERANCE


@pytest.mark.slow
def test_spatio_temporal_guidance_equals_diffusers(tmp_path):
    """STG on a block the model has (a transformer with perturbed_attn): the perturbed pass
    takes the per-token video timesteps too."""
    directory = tiny_ltx2_i2v.build_ltx2_i2v_pipeline(
        tmp_path / "pipe", seed=5, transformer=dict(perturbed_attn=True)
    )
    theirs, pipe = _both(directory)
    images = _images(len(PROMPTS))
    video, audio, joint = _noise(pipe, seed=3)
    stg = dict(stg_scale=1.5, audio_stg_scale=0.7, spatio_temporal_guidance_blocks=[1])
    want = _reference(theirs, images, audio, 3, stg, image_crf=0)
    ours_stg = {**stg, "spatio_temporal_guidance_blocks": (1,)}
    frames, wave, _ = _ours(pipe, images, video, audio, joint, ours_stg, crf=0)
    pixel_error, wave_error = _errors((frames, wave), want)
    print(f"STG: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE and wave_error < WAVE_TOLERANCE
    unperturbed = _reference(theirs, images, audio, 3, {**stg, "stg_scale": 0.0}, image_crf=0)
    assert np.abs(want[0] - unperturbed[0]).max() > 10 * PIXEL_TOLERANCE


# --- the pieces ----------------------------------------------------------------------------


@pytest.mark.parametrize("crf", [18, 33, 51])
def test_recompression_is_diffusers_frame_bit_for_bit(crf):
    """The one-frame H.264 round trip (odd sides cut to even) equals diffusers'
    apply_image_conditioning_crf, and changes the image."""
    from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

    image = tiny_ltx2_i2v.conditioning_image(37, 50, seed=crf)
    ours = np.asarray(ltx2_image.recompressed(image, crf))
    theirs = apply_image_conditioning_crf(np.array(image.convert("RGB")), crf)
    np.testing.assert_array_equal(ours, theirs)
    assert ours.shape == (36, 50, 3)
    assert np.abs(ours.astype(int) - np.asarray(image)[:36].astype(int)).max() > 10
    assert ltx2_image.recompressed(image, 0) is image


def test_pixels_are_diffusers_preprocessing():
    """Bilinear resize to the render size, [-1, 1] (the pipeline's VideoProcessor)."""
    from diffusers.video_processor import VideoProcessor

    image = tiny_ltx2_i2v.conditioning_image(*IMAGE_SIZE)
    processor = VideoProcessor(vae_scale_factor=8, resample="bilinear")
    want = processor.preprocess(image, height=HEIGHT, width=WIDTH)[0].numpy()
    np.testing.assert_array_equal(ltx2_image.pixels(image, HEIGHT, WIDTH, crf=0), want)


def test_image_inputs_follow_the_pipeline_class(pipelines):
    _, pipe = pipelines
    assert pipe.configs["pipeline"].pipeline_class == ltx2_image.I2V_PIPELINE
    assert pipe.image_inputs.image == "required"
    text_to_video = {**pipe.configs, "pipeline": ltx2_image.LTX2PipelineOptions()}
    assert pipe.family.image_inputs(text_to_video).image == "none"
    assert pipe.family.image_inputs({}).image == "none"  # a model YAML without the section
    with pytest.raises(FamilyError, match="needs an 'image'"):
        pipe.family.encode_images(pipe, [(None, None)], HEIGHT, WIDTH, NUM_FRAMES)
    with pytest.raises(FamilyError, match="last_image"):
        image = _images(1)[0]
        pipe.family.encode_images(pipe, [(image, image)], HEIGHT, WIDTH, NUM_FRAMES)
    # the cross timestep off changes diffusers' image-to-video render (not built): refused
    with pytest.raises(FamilyError, match="use_cross_timestep=False"):
        pipe.family.size_conditioning(pipe.configs, HEIGHT, WIDTH, [{"use_cross_timestep": False}])
    pipe.family.size_conditioning(text_to_video, HEIGHT, WIDTH, [{"use_cross_timestep": False}])


@pytest.mark.parametrize(
    "values, match",
    [
        (dict(pipeline_class="LTX2ConditionPipeline"), "pipeline_class"),
        (dict(image_crf=-1), "image_crf"),
        (dict(image_crf=52), "image_crf"),
        (dict(image_crf=33.0), "image_crf"),
        (dict(bogus=1), "bogus"),
    ],
)
def test_pipeline_options_are_checked(values, match):
    with pytest.raises(ValueError, match=match):
        ltx2_image.LTX2PipelineOptions.from_dict(values)


def test_first_frame_helpers():
    """The first latent frame's tokens get timestep 0 (packed f-major order), the image's
    frame replaces the video's first frame only (the audio channels kept), and its velocity
    is 0."""
    grid = (3, 2, 2)
    t = ltx2_image.video_timesteps(np.asarray([500.0, 20.0], np.float32), grid)
    np.testing.assert_array_equal(t[:, :4], 0.0)
    np.testing.assert_array_equal(t[:, 4:], [[500.0] * 8, [20.0] * 8])
    latents = np.arange(2 * 5 * 3 * 2 * 2, dtype=np.float32).reshape(2, 5, 3, 2, 2)
    image = -np.ones((2, 3, 1, 2, 2), np.float32)
    out = np.asarray(ltx2_image.with_first_frame(latents, image))
    np.testing.assert_array_equal(out[:, :3, 0], -1.0)
    np.testing.assert_array_equal(out[:, :3, 1:], latents[:, :3, 1:])
    np.testing.assert_array_equal(out[:, 3:], latents[:, 3:])
    frozen = np.asarray(ltx2_image.frozen_first_frame(latents[:, :3]))
    np.testing.assert_array_equal(frozen[:, :, 0], 0.0)
    np.testing.assert_array_equal(frozen[:, :, 1:], latents[:, :3, 1:])


def test_a_model_yaml_may_pin_the_pipeline_options(tmp_path):
    """A model YAML's ``pipeline`` section (e.g. a trained image-to-video model) is read into
    :class:`LTX2PipelineOptions`, checked by name."""
    from jaxcore.config import ConfigError
    from jaxcore.model_configs import read_model_yaml

    path = tmp_path / "ltx2_i2v.yml"
    path.write_text(
        "family: ltx2\npipeline: {pipeline_class: LTX2ImageToVideoPipeline, image_crf: 0}\n"
    )
    _, configs = read_model_yaml(path, sections=("pipeline",))
    assert configs["pipeline"] == ltx2_image.LTX2PipelineOptions(ltx2_image.I2V_PIPELINE, 0)
    assert configs["pipeline"].crf == 0 and ltx2_image.LTX2PipelineOptions().crf == 33
    path.write_text("family: ltx2\npipeline: {image_crf: 60}\n")
    with pytest.raises(ConfigError, match="image_crf"):
        read_model_yaml(path, sections=("pipeline",))
