"""The LTX-Video family vs diffusers' ``LTXPipeline`` / ``LTXImageToVideoPipeline`` on tiny
random-init pipelines (tests/support/tiny_ltx.py: every weight perturbed, a dynamically shifted
scheduler with ``shift_terminal``, a timestep-conditioned VAE with its own latent statistics and
``scaling_factor``), saved with ``save_pretrained`` and rendered by diffusers from the saved
directory.

Text-to-video: both render the same prompts from the same initial latents (diffusers takes them
packed). Image-to-video: diffusers draws the image's posterior sample and then the initial noise
from its generator; the same noise is drawn here with torch and handed to the family as the
initial latents (the tiny VAE's posterior std is ~3e-7, so the sample is the mean the family
takes). Asserted: max |diff| <= 1e-4 on [0, 1] pixels; reached 1.6e-6 (no CFG, 32 x 96),
2.4e-6 (CFG 3, guidance_rescale 0.7, frame_rate 24, decode_timestep 0.05, 64 x 32), 1.5e-6
(decode noise 0.3, diffusers handed the family's noise), 1.6e-6 (image-to-video, CFG 3,
guidance_rescale 0.3, frame_rate 30, 50 x 40 image to 64 x 32). Schedules: equal to
diffusers' bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxcore import families
from jaxcore.families import load_pipeline, ltx
from jaxcore.models import ltx_transformer
from jaxcore.sampling import initial_latents
from tests.support.tiny_ltx import SCHEDULER, build_ltx_pipeline

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
STEPS = 3
LENGTH = ltx.DEFAULT_MAX_SEQUENCE_LENGTH  # diffusers' default, 128
PROMPTS = ["a red circle on a white background", "blue square"]
NEGATIVE = ["dark background", "green"]
SEEDS = (3, 4)


@pytest.fixture(scope="module")
def t2v_dir(tmp_path_factory):
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx_t2v"), seed=1)


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory):
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx_i2v"), seed=2, image_to_video=True)


@pytest.fixture(scope="module")
def t2v(t2v_dir):
    from diffusers import LTXPipeline

    return load_pipeline(t2v_dir), LTXPipeline.from_pretrained(t2v_dir)


def _settings(frame_rate, decode_timestep, noise_scale, seeds=SEEDS) -> list[dict]:
    return [
        {
            "frame_rate": frame_rate,
            "decode_timestep": decode_timestep,
            "decode_noise_scale": noise_scale,
            "seed": seed,
        }
        for seed in seeds
    ]


def _with(cond: dict, name: str, value: float) -> dict:
    """The rows' conditioning with one decode setting at ``value`` for every row."""
    return {**cond, name: np.full_like(np.asarray(cond[name]), value)}


def _ours(pipe, size, guidance, rescale, micro, negative=None, images=None, latents=None):
    """((the loop's latents, the rows' conditioning), frames [B, F, H, W, 3]) of the family."""
    height, width, frames = size
    if latents is None:
        shape = pipe.latent_shape(height, width, frames)
        latents = np.stack([initial_latents(seed, shape) for seed in SEEDS])
    rows = latents.shape[0]
    guidances = [pipe.guidance(guidance, 1.0, None, rescale)] * rows
    cond, uncond, scales = pipe.conditioning(
        PROMPTS[:rows],
        negative or [""] * rows,
        guidances,
        LENGTH,
        images=images,
        size=size,
        micro_conditioning=micro,
    )
    z = pipe.sample(
        latents,
        cond,
        uncond,
        num_inference_steps=STEPS,
        cfg_scale=scales,
        guidance_rescale=rescale,
    )
    return (z, cond), np.asarray(pipe.decode(z, cond))


def _diffusers_t2v(torch_pipe, latents, size, guidance, rescale, settings, negative=None):
    height, width, frames = size
    packed = np.asarray(ltx_transformer.pack_latents(latents))
    return torch_pipe(
        prompt=PROMPTS,
        negative_prompt=negative,
        height=height,
        width=width,
        num_frames=frames,
        frame_rate=settings["frame_rate"],
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        guidance_rescale=rescale,
        latents=torch.from_numpy(packed),
        decode_timestep=settings["decode_timestep"],
        decode_noise_scale=settings["decode_noise_scale"],
        max_sequence_length=LENGTH,
        output_type="np",
    ).frames


def test_recognised_and_sized(t2v_dir, i2v_dir, tmp_path):
    family = families.for_pipeline(t2v_dir)
    assert family.name == "ltx" and families.for_pipeline(i2v_dir) is family
    configs = family.component_configs(t2v_dir)
    # 8 x 8 pixels and 4 frames per latent voxel; diffusers wants sizes divisible by 32
    assert family.latent_shape(configs, 32, 96, 9) == (8, 3, 4, 12)
    geometry = family.geometry(configs)
    assert (geometry.spatial_multiple, geometry.temporal_multiple) == (32, 4)
    assert family.image_inputs(configs).image == "none"
    assert family.image_inputs(family.component_configs(i2v_dir)).image == "required"
    index = json.loads((t2v_dir / "model_index.json").read_text())
    (tmp_path / "model_index.json").write_text(
        json.dumps({**index, "_class_name": "LTXConditionPipeline"})
    )
    # rendered since issue #48 (tests/jaxcore/test_ltx_condition.py)
    assert families.for_pipeline(tmp_path) is family


@pytest.mark.parametrize(
    ("config", "tokens", "steps"),
    [
        (SCHEDULER, 96, 3),
        (ltx.REFERENCE_SCHEDULER_CONFIG, 16 * 16 * 22, 40),  # 0.9.1, 512 x 704, 121 frames
        (ltx.REFERENCE_SCHEDULER_CONFIG, 7 * 15 * 20, 8),  # below base_image_seq_len
        ({}, 21 * 16 * 22, 30),  # 0.9.5 / 0.9.7: the scheduler's defaults
    ],
    ids=["tiny", "0.9.1", "0.9.1-short", "0.9.5"],
)
def test_schedule_equals_the_pipelines(config, tokens, steps):
    """LTXPipeline's ``retrieve_timesteps(sigmas=linspace(1, 1/N, N), mu=calculate_shift(F' H'
    W', ...))``: sigmas and timesteps bit for bit, ``shift_terminal`` and dynamic shifting
    included."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift, retrieve_timesteps

    config = {k: v for k, v in config.items() if not k.startswith("_")}
    reference = FlowMatchEulerDiscreteScheduler(**config)
    mu = calculate_shift(
        tokens,
        reference.config.get("base_image_seq_len", 256),
        reference.config.get("max_image_seq_len", 4096),
        reference.config.get("base_shift", 0.5),
        reference.config.get("max_shift", 1.15),
    )
    sigmas = np.linspace(1.0, 1 / steps, steps)
    timesteps, _ = retrieve_timesteps(reference, steps, "cpu", None, sigmas=sigmas, mu=mu)
    pipe = types.SimpleNamespace(scheduler_config=dict(reference.config), source="tiny")
    state, _ = ltx.LTXFamily().make_schedule(pipe, "flow_euler", steps, 1.0, (1, 8, tokens, 1, 1))
    np.testing.assert_array_equal(np.asarray(state.sigmas), reference.sigmas.numpy())
    np.testing.assert_array_equal(np.asarray(state.timesteps), timesteps.numpy())


@pytest.mark.parametrize(
    ("size", "guidance", "rescale", "frame_rate", "decode_timestep"),
    [((32, 96, 9), 1.0, 0.0, 25, 0.0), ((64, 32, 5), 3.0, 0.7, 24, 0.05)],
    ids=["plain-wide", "cfg-rescale-24fps-decode-timestep-tall"],
)
def test_text_to_video_matches_diffusers(t2v, size, guidance, rescale, frame_rate, decode_timestep):
    ours_pipe, torch_pipe = t2v
    negative = NEGATIVE if guidance > 1 else None
    micro = _settings(frame_rate, decode_timestep, 0.0)
    z, ours = _ours(ours_pipe, size, guidance, rescale, micro, negative)
    latents = np.stack([initial_latents(s, ours_pipe.latent_shape(*size)) for s in SEEDS])
    reference = _diffusers_t2v(torch_pipe, latents, size, guidance, rescale, micro[0], negative)
    height, width, frames = size
    assert ours.shape == reference.shape == (2, frames, height, width, 3)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)
    assert np.abs(ours[0] - ours[1]).max() > 1e-2  # the prompt matters
    if guidance > 1:  # the frame rate and the decode timestep matter
        _, other_rate = _ours(
            ours_pipe, size, guidance, rescale, _settings(25, 0.05, 0.0), negative
        )
        assert np.abs(ours - other_rate).max() > 1e-3
        z, cond = z
        at_zero = np.asarray(ours_pipe.decode(z, _with(cond, ltx.DECODE_TIMESTEP, 0.0)))
        assert np.abs(ours - at_zero).max() > 1e-3


def test_decode_noise_comes_from_the_seed_and_mixes_as_diffusers(t2v, monkeypatch):
    """decode_noise_scale 0.3: diffusers handed the family's noise (its ``randn_tensor``
    replaced) renders the same; the noise is each prompt's own, from its seed."""
    import diffusers.pipelines.ltx.pipeline_ltx as pipeline_ltx

    ours_pipe, torch_pipe = t2v
    size = (32, 96, 9)
    z, ours = _ours(ours_pipe, size, 1.0, 0.0, _settings(25, 0.05, 0.3))
    shape = ours_pipe.latent_shape(*size)
    seeds = np.asarray([ltx.seed_words(s) for s in SEEDS], np.uint32)
    noise = np.asarray(ltx.decode_noise(seeds, shape))

    def family_noise(requested, **kwargs):
        assert tuple(requested) == noise.shape
        return torch.from_numpy(noise.copy())

    monkeypatch.setattr(pipeline_ltx, "randn_tensor", family_noise)
    latents = np.stack([initial_latents(s, shape) for s in SEEDS])
    settings = {"frame_rate": 25, "decode_timestep": 0.05, "decode_noise_scale": 0.3}
    reference = _diffusers_t2v(torch_pipe, latents, size, 1.0, 0.0, settings)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)

    z, cond = z
    silent = np.asarray(ours_pipe.decode(z, _with(cond, ltx.DECODE_NOISE_SCALE, 0.0)))
    assert np.abs(ours - silent).max() > 1e-2  # the noise does something
    swapped = {**cond, ltx.DECODE_SEED: cond[ltx.DECODE_SEED][::-1]}  # the other row's noise
    assert np.abs(np.asarray(ours_pipe.decode(z, swapped)) - ours).max() > 1e-2
    np.testing.assert_array_equal(np.asarray(ours_pipe.decode(z, cond)), ours)  # deterministic
    bare = np.asarray(ours_pipe.decode(z))  # no conditioning: timestep 0, no noise
    at_zero = _with(_with(cond, ltx.DECODE_TIMESTEP, 0.0), ltx.DECODE_NOISE_SCALE, 0.0)
    np.testing.assert_array_equal(bare, np.asarray(ours_pipe.decode(z, at_zero)))


def test_image_to_video_matches_diffusers(i2v_dir):
    """An image of another size than the render (50 x 40 -> 64 x 32), CFG with
    guidance_rescale, 30 fps, decode timestep 0.05."""
    from diffusers import LTXImageToVideoPipeline
    from PIL import Image

    ours_pipe = load_pipeline(i2v_dir)
    torch_pipe = LTXImageToVideoPipeline.from_pretrained(i2v_dir)
    size, seed = (64, 32, 9), 7
    shape = ours_pipe.latent_shape(*size)
    generator = torch.Generator().manual_seed(seed)
    torch.randn((1, shape[0], 1, *shape[2:]), generator=generator)  # the image's sample
    noise = torch.randn((1, *shape), generator=generator).numpy()
    pixels = np.random.default_rng(0).integers(0, 256, (50, 40, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    micro = _settings(30, 0.05, 0.0, seeds=(seed,))
    _, ours = _ours(ours_pipe, size, 3.0, 0.3, micro, ["dog"], [(image, None)], noise)
    reference = torch_pipe(
        image=image,
        prompt=PROMPTS[0],
        negative_prompt="dog",
        height=size[0],
        width=size[1],
        num_frames=size[2],
        frame_rate=30,
        num_inference_steps=STEPS,
        guidance_scale=3.0,
        guidance_rescale=0.3,
        generator=torch.Generator().manual_seed(seed),
        decode_timestep=0.05,
        decode_noise_scale=0.0,
        max_sequence_length=LENGTH,
        output_type="np",
    ).frames
    assert ours.shape == reference.shape == (1, 9, 64, 32, 3)
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)
    flipped = [(image.transpose(Image.Transpose.FLIP_TOP_BOTTOM), None)]
    _, other = _ours(ours_pipe, size, 3.0, 0.3, micro, ["dog"], flipped, noise)
    assert np.abs(other - ours).max() > 1e-2  # the image matters
    with pytest.raises(families.FamilyError, match="needs an 'image'"):
        _ours(ours_pipe, size, 3.0, 0.3, micro, ["dog"], [(None, None)], noise)


def test_injected_decoder_noise_is_each_prompts_own(tmp_path):
    """A decoder that injects noise (0.9.1's; diffusers draws it with the global torch RNG):
    each prompt's comes from its seed, so a row renders the same alone (no mesh) as in a
    batch of 8 on 8 devices (atol 1e-5, reached 7.2e-7), and another seed renders otherwise."""
    from jaxcore.compute import ComputeConfig
    from jaxcore.sharding import MeshConfig, make_mesh

    noisy = {"decoder_inject_noise": (False, True, False, True)}
    directory = build_ltx_pipeline(tmp_path / "noisy", seed=5, vae=noisy)
    batched = load_pipeline(directory, ComputeConfig(), make_mesh(MeshConfig()))
    assert batched.configs["vae"].injects_noise and batched.batch_ways == 8
    size, seeds = (32, 32, 5), tuple(range(20, 28))
    shape = batched.latent_shape(*size)
    latents = np.stack([initial_latents(s, shape) for s in seeds])

    def render(pipe, rows, row_seeds):
        guidances = [pipe.guidance(1.0)] * len(rows)
        micro = _settings(25, 0.05, None, seeds=row_seeds)
        cond, _, scales = pipe.conditioning(
            ["x"] * len(rows), [""] * len(rows), guidances, 16, size=size, micro_conditioning=micro
        )
        z = pipe.sample(rows, cond, None, num_inference_steps=2, cfg_scale=scales)
        return np.asarray(pipe.decode(z, cond))

    in_batch = render(batched, latents, seeds)
    alone = load_pipeline(directory)
    np.testing.assert_allclose(render(alone, latents[3:4], seeds[3:4])[0], in_batch[3], atol=1e-5)
    other_seed = render(alone, latents[3:4], (99,))[0]
    assert np.abs(other_seed - in_batch[3]).max() > 1e-3


def test_settings_the_pipelines_do_not_have_are_refused(t2v):
    ours_pipe, _ = t2v
    family, configs = ours_pipe.family, ours_pipe.configs
    for values, message in (
        ({"frame_rate": 0}, "frame_rate=0.0: must be > 0"),
        ({"decode_noise_scale": 1.5}, r"decode_noise_scale=1.5: must be in \[0, 1\]"),
        ({"decode_timestep": -1}, "decode_timestep=-1.0: must be >= 0"),
        ({"original_size": (8, 8)}, r"\['original_size'\]: not settings of LTX-Video"),
    ):
        with pytest.raises(families.FamilyError, match=message):
            family.size_conditioning(configs, 32, 32, [values])
    with pytest.raises(families.FamilyError, match="true_cfg_scale=2.0: LTX-Video has no"):
        ours_pipe.guidance(3.0, 2.0)
    with pytest.raises(families.FamilyError, match="guidance_scale_2"):
        ours_pipe.guidance(3.0, 1.0, 2.0)
    narrow = dataclasses.replace(configs["transformer"], caption_channels=24)
    with pytest.raises(families.FamilyError, match="caption_channels 24 != text_encoder d_model"):
        family.check_configs({**configs, "transformer": narrow}, "tiny")
    patched = dataclasses.replace(configs["transformer"], patch_size=2)
    with pytest.raises(families.FamilyError, match="only 1 / 1"):
        family.check_configs({**configs, "transformer": patched}, "tiny")


@pytest.mark.parametrize(
    ("name", "transformer_params", "vae_params"),
    [
        ("ltx_video_2b_0.9.1", 1_923_385_472, 934_976_434),
        ("ltx_video_2b_0.9.5", 1_923_385_472, 1_246_913_522),
        ("ltx_video_13b_0.9.7", 13_042_569_344, 1_246_913_522),
    ],
)
def test_real_configs_count_like_diffusers(name, transformer_params, vae_params):
    """The YAMLs' architectures built by diffusers on the meta device count as ours do."""
    from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

    from jaxcore.model_configs import read_model_yaml
    from jaxcore.models import ltx_vae, t5

    family, configs = read_model_yaml(REPO / f"configs/models/{name}.yml")
    assert family.name == "ltx"
    with torch.device("meta"):
        transformer = LTXVideoTransformer3DModel(**configs["transformer"].to_dict())
        vae = AutoencoderKLLTXVideo(**configs["vae"].to_dict())
    assert sum(p.numel() for p in transformer.parameters()) == transformer_params
    assert sum(p.numel() for p in vae.parameters()) == vae_params
    assert ltx_transformer.count_params(configs["transformer"]) == transformer_params
    assert ltx_vae.count_params(configs["vae"]) == vae_params
    assert t5.count_params(configs["text_encoder"]) == 4_762_310_656  # T5 v1.1 XXL
    assert family.latent_shape(configs, 512, 704, 121) == (128, 16, 16, 22)
    assert family.geometry(configs).temporal_multiple == 8
    assert family.sampling_defaults(configs)["frame_rate"] == 25.0
