"""The ``ltx2`` family end to end vs diffusers' ``LTX2Pipeline.__call__`` (a tiny random-init
pipeline, every parameter perturbed, saved with save_pretrained; fp32 on CPU).

Both sides start from the same initial video AND audio latents (diffusers takes them
de-normalised: its ``prepare_latents`` / ``prepare_audio_latents`` normalise what they are
given) and render through the library's Pipeline API (load_pipeline, conditioning, sample,
decode, decode_audio); video pixels in [0, 1] and the waveform agree within 1e-4, with and
without classifier-free guidance, at another ``frame_rate`` and ``motion_speed``, and with
``noise_scale`` on given latents (diffusers' torch noise replaced by the family's draw).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxcore import families
from jaxcore.families import ltx2
from jaxcore.families.base import FamilyError
from jaxcore.family_types import Guidance
from tests.support import tiny_ltx2

PIXEL_TOLERANCE = 1e-4  # max abs on [0, 1] pixels
WAVE_TOLERANCE = 1e-4  # max abs on the waveform (tanh: in [-1, 1])
HEIGHT = WIDTH = 32  # diffusers' check_inputs: multiples of 32
NUM_FRAMES = 9  # 3 latent frames; audio: round(9 / 24 * 25) = 9 latent frames
STEPS = 3
MAX_SEQUENCE_LENGTH = 16  # a multiple of the connectors' 8 registers
PROMPTS = ["a red fox in the snow", "a cat on a mat"]
NEGATIVES = ["", "a long prompt"]
# diffusers' default STG (scale 1 at block 28) switched off where a test compares guidance
# without it (the tiny model has 2 blocks: block 28 would perturb nothing anyway)
OFF = dict(stg_scale=0.0, audio_stg_scale=0.0)
GUIDANCE_KEYS = (
    "guidance_scale",
    "guidance_rescale",
    "audio_guidance_scale",
    "audio_guidance_rescale",
    "modality_scale",
    "audio_modality_scale",
)
# name -> GUIDANCE_KEYS' values; None for the audio: the video's value (diffusers' `or`)
GUIDANCE = {
    "no_cfg": (1.0, 0.0, None, None, 1.0, None),
    "cfg": (3.0, 0.0, None, None, 1.0, None),
    "cfg_audio_scale": (3.0, 0.0, 6.0, None, 1.0, None),
    "cfg_rescale": (3.0, 0.7, None, None, 1.0, None),
    "cfg_audio_scale_both_rescales": (2.5, 0.6, 5.0, 0.3, 1.0, None),
    "no_cfg_modality_rescale": (1.0, 0.5, None, None, 3.0, None),
    "cfg_both_modality_scales": (3.0, 0.7, 7.0, None, 2.0, 4.0),
    # the video unguided, the audio guided: diffusers' CFG runs for the audio's scale alone
    "audio_cfg_only": (1.0, 0.0, 7.0, 0.7, 1.0, None),
}
# the default tier: without and with CFG, and everything built at once; the rest is `slow`
FAST = ("no_cfg", "cfg", "cfg_both_modality_scales", "audio_cfg_only")


def _both(directory):
    """(diffusers LTX2Pipeline, our Pipeline) of one tiny folder."""
    from diffusers import LTX2Pipeline

    theirs = LTX2Pipeline.from_pretrained(directory, dtype=torch.float32)
    return theirs, families.load_pipeline(directory)


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory):
    return _both(tiny_ltx2.build_ltx2_pipeline(tmp_path_factory.mktemp("ltx2_pipeline")))


@pytest.fixture(scope="module")
def references(pipelines):
    """diffusers' renders by GUIDANCE name, each made once."""
    theirs, pipe = pipelines
    video, audio, _ = _initial_latents(pipe)
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _reference(theirs, video, audio, GUIDANCE[name])
        return cache[name]

    return get


def _initial_latents(pipe, seed: int = 0, frame_rate: float = ltx2.FRAME_RATE):
    """Normalised video ``[B, C, F', H', W']`` and audio ``[B, C_a, L, M']`` noise."""
    shape = pipe.latent_shape(HEIGHT, WIDTH, NUM_FRAMES, {"frame_rate": frame_rate})
    joint = ltx2.layout(pipe.configs, shape[1:], frame_rate)
    rng = np.random.default_rng(seed)
    batch = len(PROMPTS)
    video = rng.standard_normal((batch, joint.channels, *joint.grid), np.float32)
    mel_bins = joint.audio_width // pipe.configs["audio_vae"].latent_channels
    audio = rng.standard_normal(
        (batch, pipe.configs["audio_vae"].latent_channels, joint.audio_frames, mel_bins),
        np.float32,
    )
    return video, audio, joint


def _denormalised(theirs, video, audio):
    """What diffusers' ``latents=`` / ``audio_latents=`` take for these normalised latents."""
    vae, audio_vae = theirs.vae, theirs.audio_vae
    mean = vae.latents_mean.view(1, -1, 1, 1, 1)
    std = vae.latents_std.view(1, -1, 1, 1, 1)
    video_t = torch.from_numpy(video) * std / vae.config.scaling_factor + mean
    packed = theirs._pack_audio_latents(torch.from_numpy(audio))
    packed = packed * audio_vae.latents_std + audio_vae.latents_mean
    audio_t = theirs._unpack_audio_latents(packed, audio.shape[2], num_mel_bins=audio.shape[3])
    return video_t, audio_t


def _reference(theirs, video, audio, guidance, **options):
    video_t, audio_t = _denormalised(theirs, video, audio)
    options = {"frame_rate": ltx2.FRAME_RATE, **OFF, **options}
    with torch.no_grad():
        out = theirs(
            prompt=PROMPTS,
            negative_prompt=NEGATIVES,
            height=HEIGHT,
            width=WIDTH,
            num_frames=NUM_FRAMES,
            num_inference_steps=STEPS,
            latents=video_t,
            audio_latents=audio_t,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
            output_type="np",
            return_dict=False,
            **{**dict(zip(GUIDANCE_KEYS, guidance, strict=True)), **options},
        )
    frames, wave = out
    return np.asarray(frames, np.float32), wave.float().numpy()


def _ours(pipe, video, audio, joint, guidance, batched_cfg: bool = True, latents=None, **settings):
    """Our render; ``latents``: the loop's initial latents (else video and audio joined)."""
    scale, rescale, *per_prompt = guidance
    settings = {**dict(zip(GUIDANCE_KEYS[2:], per_prompt, strict=True)), **settings}
    row = pipe.guidance(scale, guidance_rescale=rescale, settings=settings)
    cond, uncond, scales = pipe.conditioning(
        PROMPTS,
        NEGATIVES,
        [row] * len(PROMPTS),
        MAX_SEQUENCE_LENGTH,
        size=(HEIGHT, WIDTH, NUM_FRAMES),
        micro_conditioning=[settings] * len(PROMPTS),
    )
    if latents is None:
        latents = ltx2.joint_latents(video, audio, joint)
    result = pipe.sample(
        latents,
        cond,
        uncond,
        num_inference_steps=STEPS,
        cfg_scale=scales,
        batched_cfg=batched_cfg,
        guidance_rescale=[row.guidance_rescale] * len(PROMPTS),
    )
    frames = np.asarray(pipe.decode(result, cond))
    wave, rate = pipe.family.decode_audio(pipe, result, cond)
    return frames, wave, rate


@pytest.mark.parametrize(
    "name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in GUIDANCE]
)
def test_render_equals_diffusers(pipelines, references, name):
    _, pipe = pipelines
    video, audio, joint = _initial_latents(pipe)
    want_frames, want_wave = references(name)
    frames, wave, rate = _ours(pipe, video, audio, joint, GUIDANCE[name])

    assert frames.shape == want_frames.shape == (len(PROMPTS), NUM_FRAMES, HEIGHT, WIDTH, 3)
    assert wave.shape == want_wave.shape and wave.dtype == np.float32
    assert rate == tiny_ltx2.PIPELINE_VOCODER["output_sampling_rate"]
    # not trivially equal: the render varies across pixels and samples
    assert want_frames.std() > 1e-2 and want_wave.std() > 1e-3
    pixel_error = np.abs(frames - want_frames).max()
    wave_error = np.abs(wave - want_wave).max()
    print(f"{name}: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE
    assert wave_error < WAVE_TOLERANCE
    if name != "cfg":  # each setting changes diffusers' render well beyond the tolerance
        plain_frames, plain_wave = references("cfg")
        changed = max(
            np.abs(want_frames - plain_frames).max(), np.abs(want_wave - plain_wave).max()
        )
        print(f"{name}: changes diffusers' render by {changed:.2e} (vs cfg)")
        assert changed > 10 * max(PIXEL_TOLERANCE, WAVE_TOLERANCE)


@pytest.mark.slow
def test_decode_timestep_of_a_conditioned_vae_equals_diffusers(tmp_path):
    """A timestep-conditioned VAE decodes at the prompt's decode_timestep (the decode noise
    scaled to 0, so diffusers' torch draw does not enter)."""
    directory = tiny_ltx2.build_ltx2_pipeline(
        tmp_path,
        seed=3,
        vae=tiny_ltx2.PIPELINE_CONDITIONED_VAE,
        transformer=tiny_ltx2.PIPELINE_CONDITIONED_TRANSFORMER,
    )
    theirs, pipe = _both(directory)
    video, audio, joint = _initial_latents(pipe, seed=2)
    decode = dict(decode_timestep=0.05, decode_noise_scale=0.0)
    want_frames, want_wave = _reference(theirs, video, audio, GUIDANCE["no_cfg"], **decode)
    frames, wave, _ = _ours(pipe, video, audio, joint, GUIDANCE["no_cfg"], **decode)
    at_zero, _, _ = _ours(pipe, video, audio, joint, GUIDANCE["no_cfg"])
    pixel_error = np.abs(frames - want_frames).max()
    print(f"decode_timestep: pixels {pixel_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE
    assert np.abs(wave - want_wave).max() < WAVE_TOLERANCE
    assert np.abs(frames - at_zero).max() > 100 * PIXEL_TOLERANCE  # the timestep matters


@pytest.mark.slow
def test_use_cross_timestep_is_the_same_render(pipelines, references):
    """Both modalities denoise at one timestep in LTX2Pipeline, so each one's cross-modal
    timestep is its own: diffusers renders the same with use_cross_timestep off, and the family
    accepts either value."""
    theirs, pipe = pipelines
    video, audio, _ = _initial_latents(pipe)
    frames, wave = _reference(theirs, video, audio, GUIDANCE["no_cfg"], use_cross_timestep=False)
    want_frames, want_wave = references("no_cfg")
    np.testing.assert_array_equal(frames, want_frames)
    np.testing.assert_array_equal(wave, want_wave)
    for value in (True, False):
        pipe.family.size_conditioning(pipe.configs, HEIGHT, WIDTH, [{"use_cross_timestep": value}])


def test_conditioning_specs_are_what_conditioning_makes(pipelines):
    _, pipe = pipelines
    row = pipe.guidance(1.0)
    cond, _, _ = pipe.conditioning(["a fox"], [""], [row], MAX_SEQUENCE_LENGTH)
    shape = pipe.latent_shape(HEIGHT, WIDTH, NUM_FRAMES)
    for spec in pipe.family.conditioning_specs(pipe.denoiser.config, MAX_SEQUENCE_LENGTH, shape):
        assert cond[spec.name].shape[1:] == spec.shape, spec.name


def test_joint_latents_round_trip_and_layout(pipelines):
    """The loop's latents hold the video as given and the audio's packed tokens ([L, C_a M'],
    feature c M' + m) after it, zeros past them; split_latents gives both back."""
    _, pipe = pipelines
    video, audio, joint = _initial_latents(pipe, seed=1)
    latents = ltx2.joint_latents(video, audio, joint)
    assert latents.shape[1:] == pipe.latent_shape(HEIGHT, WIDTH, NUM_FRAMES)
    got_video, got_audio = ltx2.split_latents(latents, joint)
    np.testing.assert_array_equal(got_video, video)
    packed = np.transpose(audio, (0, 2, 1, 3)).reshape(audio.shape[0], audio.shape[2], -1)
    np.testing.assert_array_equal(got_audio, packed)
    tail = latents[:, joint.channels :].reshape(len(video), -1)[:, joint.audio_size :]
    assert tail.size and not tail.any()
    tokens = pipe.family.tokens_per_example(pipe.denoiser.config, latents.shape[1:])
    assert tokens == joint.video_tokens + joint.audio_frames == 3 * 4 * 4 + 9
    # ltx-trainer shifts its timestep sampler by the video's tokens alone
    assert pipe.family.timestep_tokens(pipe.denoiser.config, latents.shape[1:]) == 3 * 4 * 4


@pytest.mark.parametrize(
    "setting, value",
    [
        ("stg_scale", -1.0),
        ("audio_stg_scale", float("inf")),
        ("spatio_temporal_guidance_blocks", [1, -1]),
        ("modality_scale", float("nan")),
        ("audio_guidance_scale", -1.0),
        ("noise_scale", 1.5),
        ("use_cross_timestep", 1),
        ("frame_rate", 0.0),
        ("motion_speed", -1.0),
        ("bogus", 1),
    ],
)
def test_bad_settings_are_refused_by_name(pipelines, setting, value):
    _, pipe = pipelines
    with pytest.raises(FamilyError, match=setting):
        pipe.family.size_conditioning(pipe.configs, HEIGHT, WIDTH, [{setting: value}])


def test_guidance_keeps_the_loops_rescale_off(pipelines):
    """The family rescales each modality's x0 itself; the loop gets no rescale, and settings
    the family has not are refused by name."""
    _, pipe = pipelines
    row = pipe.guidance(3.0, guidance_rescale=0.7)
    assert row.cfg_scale == 3.0 and row.guidance_rescale == 0.0
    assert row.embedded == {ltx2.GUIDANCE_SCALE: 3.0, ltx2.GUIDANCE_RESCALE: 0.7}
    with pytest.raises(FamilyError, match="true_cfg_scale"):
        pipe.guidance(3.0, true_cfg_scale=2.0)
    with pytest.raises(FamilyError, match="guidance_rescale"):
        pipe.guidance(3.0, guidance_rescale=-0.5)
    assert pipe.guidance(3.0) == Guidance(
        3.0, {ltx2.GUIDANCE_SCALE: 3.0, ltx2.GUIDANCE_RESCALE: 0.0}
    )


@pytest.mark.slow
def test_unbatched_cfg_equals_batched_or_fails_loudly(pipelines):
    """Two CFG calls per step (batched_cfg=False): one scale and no rescale is the loop's
    velocity CFG, the same render; per-modality guidance cannot be done so: NaN, not a
    different render."""
    _, pipe = pipelines
    video, audio, joint = _initial_latents(pipe)
    plain = GUIDANCE["cfg"]
    batched = _ours(pipe, video, audio, joint, plain)
    unbatched = _ours(pipe, video, audio, joint, plain, batched_cfg=False)
    assert np.abs(batched[0] - unbatched[0]).max() < 1e-5
    assert np.abs(batched[1] - unbatched[1]).max() < 1e-5
    frames, wave, _ = _ours(pipe, video, audio, joint, GUIDANCE["cfg_rescale"], batched_cfg=False)
    assert np.isnan(frames).all() and np.isnan(wave).all()


# --- spatio-temporal guidance (a transformer with perturbed_attn) ----------------------------

# name -> (GUIDANCE name, STG settings as LTX2Pipeline.__call__ takes them)
STG = {
    "stg_cfg": ("cfg", dict(stg_scale=1.0, spatio_temporal_guidance_blocks=[1])),
    "stg_no_cfg_audio_scale": (
        "no_cfg",
        dict(stg_scale=0.5, audio_stg_scale=2.0, spatio_temporal_guidance_blocks=[0]),
    ),
    "stg_everything": (
        "cfg_both_modality_scales",
        dict(stg_scale=1.5, audio_stg_scale=0.7, spatio_temporal_guidance_blocks=[0, 1]),
    ),
}


@pytest.fixture(scope="module")
def perturbed_pipelines(tmp_path_factory):
    directory = tiny_ltx2.build_ltx2_pipeline(
        tmp_path_factory.mktemp("ltx2_stg"), seed=5, transformer=dict(perturbed_attn=True)
    )
    return _both(directory)


@pytest.mark.parametrize(
    "name", [n if n == "stg_everything" else pytest.param(n, marks=pytest.mark.slow) for n in STG]
)
def test_spatio_temporal_guidance_equals_diffusers(perturbed_pipelines, name):
    """STG on a transformer with ``perturbed_attn``: the family's perturbed pass (per-row,
    per-block weights) and delta ``stg (x0_c - x0_p)`` per modality against diffusers' render
    with the same scales and block list, within the pixel / waveform tolerances; and the STG
    changes diffusers' render (so a family that ignored it would fail)."""
    theirs, pipe = perturbed_pipelines
    guidance, stg = STG[name]
    video, audio, joint = _initial_latents(pipe, seed=4)
    want_frames, want_wave = _reference(theirs, video, audio, GUIDANCE[guidance], **stg)
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in stg.items()}
    frames, wave, _ = _ours(pipe, video, audio, joint, GUIDANCE[guidance], **settings)
    pixel_error = np.abs(frames - want_frames).max()
    wave_error = np.abs(wave - want_wave).max()
    print(f"{name}: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE and wave_error < WAVE_TOLERANCE
    plain_frames, plain_wave = _reference(theirs, video, audio, GUIDANCE[guidance])
    changed = max(np.abs(want_frames - plain_frames).max(), np.abs(want_wave - plain_wave).max())
    print(f"{name}: STG changes diffusers' render by {changed:.2e}")
    assert changed > 10 * max(PIXEL_TOLERANCE, WAVE_TOLERANCE)


def test_stg_pass_runs_only_where_it_perturbs(pipelines, perturbed_pipelines):
    """The STG pass's inputs exist only for a model with perturbed_attn and a row perturbing
    one of its blocks (diffusers' default block 28 on a 2-block model, or a model without
    perturbed_attn: diffusers' pass equals the conditional one); a batch may mix block lists
    (per-row weights, 0 at a row's blocks); scales without blocks are refused as diffusers'
    check_inputs refuses them."""
    _, plain = pipelines
    _, perturbed = perturbed_pipelines
    default = dict(stg_scale=1.0, spatio_temporal_guidance_blocks=ltx2.DEFAULT_STG_BLOCKS)
    for pipe in (plain, perturbed):
        cond, _ = pipe.family.size_conditioning(pipe.configs, HEIGHT, WIDTH, [default])
        assert ltx2.STG_LAYERS not in cond
    on_block_1 = dict(stg_scale=1.0, spatio_temporal_guidance_blocks=(1,))
    cond, _ = plain.family.size_conditioning(plain.configs, HEIGHT, WIDTH, [on_block_1])
    assert ltx2.STG_LAYERS not in cond
    rows = [
        on_block_1,
        dict(stg_scale=0.0),
        dict(audio_stg_scale=2.0, stg_scale=0.0, **{"spatio_temporal_guidance_blocks": (0, 1, 28)}),
    ]
    cond, uncond = perturbed.family.size_conditioning(perturbed.configs, HEIGHT, WIDTH, rows)
    np.testing.assert_array_equal(cond[ltx2.STG_LAYERS], [[1, 0], [1, 1], [0, 0]])
    np.testing.assert_array_equal(cond[ltx2.STG_SCALE], [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(cond[ltx2.AUDIO_STG_SCALE], [1.0, 0.0, 2.0])
    np.testing.assert_array_equal(uncond[ltx2.STG_LAYERS], cond[ltx2.STG_LAYERS])
    with pytest.raises(FamilyError, match="spatio_temporal_guidance_blocks"):
        perturbed.family.size_conditioning(perturbed.configs, HEIGHT, WIDTH, [{"stg_scale": 1.0}])


# --- an LTX-2.3-style pipeline ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ltx23_pipelines(tmp_path_factory):
    return _both(tiny_ltx2.build_ltx23_pipeline(tmp_path_factory.mktemp("ltx23"), seed=6))


@pytest.mark.parametrize(
    "name, guidance, options",
    [
        ("no_cfg", "no_cfg", {}),
        pytest.param(
            "everything",
            "cfg_both_modality_scales",
            dict(stg_scale=1.0, audio_stg_scale=0.5, spatio_temporal_guidance_blocks=[1]),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_an_ltx23_pipeline_renders_as_diffusers(ltx23_pipelines, name, guidance, options):
    """LTX-2.3's pieces in one LTX2Pipeline (gated attention, prompt modulation, captions at
    the attention widths from per-modality connectors, STG-capable blocks, the bandwidth-
    extending vocoder at 48 kHz): pixels and waveform within the tolerances of diffusers'."""
    theirs, pipe = ltx23_pipelines
    video, audio, joint = _initial_latents(pipe, seed=7)
    want_frames, want_wave = _reference(theirs, video, audio, GUIDANCE[guidance], **options)
    settings = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    frames, wave, rate = _ours(pipe, video, audio, joint, GUIDANCE[guidance], **settings)
    assert rate == tiny_ltx2.PIPELINE_VOCODER_BWE["output_sampling_rate"]
    assert wave.shape == want_wave.shape and want_wave.std() > 1e-3
    pixel_error = np.abs(frames - want_frames).max()
    wave_error = np.abs(wave - want_wave).max()
    print(f"ltx23 {name}: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE and wave_error < WAVE_TOLERANCE


# --- frame rate, motion speed, noise scale ----------------------------------------------------


def test_frame_rate_and_motion_speed_equal_diffusers(pipelines, references):
    """At 16 fps the sound of 9 frames is 14 latent frames (9 at 24): the latents' shape, the
    audio's coordinates and the waveform's length follow the prompt's frame rate; the video's
    coordinates read frame_rate / motion_speed (diffusers' conditioning_frame_rate)."""
    theirs, pipe = pipelines
    rate, speed = 16.0, 0.5
    video, audio, joint = _initial_latents(pipe, frame_rate=rate)
    assert joint.audio_frames == round(NUM_FRAMES / rate * 25) == 14
    settings = dict(frame_rate=rate, motion_speed=speed)
    want_frames, want_wave = _reference(theirs, video, audio, GUIDANCE["cfg"], **settings)
    frames, wave, _ = _ours(pipe, video, audio, joint, GUIDANCE["cfg"], **settings)
    assert wave.shape == want_wave.shape
    pixel_error = np.abs(frames - want_frames).max()
    wave_error = np.abs(wave - want_wave).max()
    print(
        f"frame_rate {rate}, motion_speed {speed}: pixels {pixel_error:.2e}, wave {wave_error:.2e}"
    )
    assert pixel_error < PIXEL_TOLERANCE and wave_error < WAVE_TOLERANCE
    # the motion speed alone moves diffusers' frames (the video's coordinates), and the
    # frame rate the sound's length
    plain_frames, plain_wave = _reference(theirs, video, audio, GUIDANCE["cfg"], frame_rate=rate)
    moved = np.abs(want_frames - plain_frames).max()
    print(f"motion_speed {speed} moves diffusers' frames by {moved:.2e}")
    assert moved > 10 * PIXEL_TOLERANCE
    assert plain_wave.shape[-1] > references("cfg")[1].shape[-1]


def test_a_batch_shares_one_frame_rate(pipelines):
    """Rows whose sounds differ in length cannot share a batch: refused, naming the rates."""
    _, pipe = pipelines
    rows = [{"frame_rate": 24.0}, {"frame_rate": 16.0}]
    with pytest.raises(FamilyError, match="frame_rate"):
        pipe.family.size_conditioning(pipe.configs, HEIGHT, WIDTH, rows, NUM_FRAMES)
    with pytest.raises(FamilyError, match="num_frames"):  # the length needs the frame count
        pipe.family.size_conditioning(pipe.configs, HEIGHT, WIDTH, rows[1:])


def test_noise_scale_equals_diffusers(pipelines, monkeypatch):
    """Given latents noised by ``noise_scale`` (diffusers' ``_create_noised_state``, video and
    audio): diffusers' torch draw is replaced by the noise the family draws from each row's
    seed, packed as diffusers packs it; the renders then agree."""
    from jaxcore.sampling import initial_latent_parts

    theirs, pipe = pipelines
    scale, seeds = 0.3, (11, 12)
    video, audio, joint = _initial_latents(pipe, seed=4)
    shape = joint.shape
    settings = {"noise_scale": scale}
    ours = np.stack(
        [
            pipe.family.initial_latents(
                pipe.configs,
                shape,
                seed,
                {"latents": video[row], "audio_latents": audio[row]},
                settings,
            )
            for row, seed in enumerate(seeds)
        ]
    )
    draws = [initial_latent_parts(s, [video.shape[1:], audio.shape[1:]]) for s in seeds]
    noise_video = torch.from_numpy(np.stack([d[0] for d in draws]))
    noise_audio = torch.from_numpy(np.stack([d[1] for d in draws]))
    packed = {
        "video": theirs._pack_latents(noise_video, 1, 1),
        "audio": theirs._pack_audio_latents(noise_audio),
    }
    calls = []

    def noised(latents, noise_scale, generator=None):
        kind = "video" if latents.shape == packed["video"].shape else "audio"
        calls.append(kind)
        return noise_scale * packed[kind] + (1 - noise_scale) * latents

    monkeypatch.setattr(type(theirs), "_create_noised_state", staticmethod(noised))
    guidance = GUIDANCE["cfg"]
    want_frames, want_wave = _reference(theirs, video, audio, guidance, noise_scale=scale)
    assert calls == ["video", "audio"]
    frames, wave, _ = _ours(pipe, video, audio, joint, guidance, latents=ours, **settings)
    pixel_error = np.abs(frames - want_frames).max()
    wave_error = np.abs(wave - want_wave).max()
    print(f"noise_scale {scale}: pixels {pixel_error:.2e}, waveform {wave_error:.2e}")
    assert pixel_error < PIXEL_TOLERANCE and wave_error < WAVE_TOLERANCE
    plain = ltx2.joint_latents(video, audio, joint)
    assert np.abs(ours - plain).max() > 0.1  # the noise moved the start
