"""The LTX-Video family vs diffusers' ``LTXConditionPipeline`` (issue #48) on a tiny random-init
pipeline (tests/support/tiny_ltx.py with ``condition=True``: every weight perturbed, the
scheduler's defaults as 0.9.5 / 0.9.7 ship, a timestep-conditioned VAE with its own latent
statistics), saved with ``save_pretrained`` and rendered by diffusers from the saved directory.

diffusers draws its initial noise first from its generator (then the conditions' posterior
samples, whose std is ~3e-7 in the tiny VAE): the same noise is drawn here with torch and handed
to the family as the initial latents. Settings where diffusers' other torch draws do not enter:
``image_cond_noise_scale=0``, strength 1 for conditions at ``frame_index`` > 0, decode noise 0.
Asserted: max |diff| <= 1e-4 on [0, 1] pixels; reached 1.9e-6 (one image at frame 0, CFG 3,
2 prompts, 32 x 64, 9 frames) and 1.8e-6 (an image at frame 0 with strength 0.6 and a 9-frame
video at frame 4: two extra latent frames plus one blended into the video, CFG 3, frame_rate
24, 32 x 32, 17 frames). Schedule: equal to diffusers' bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from jaxcore import families
from jaxcore.families import load_pipeline, ltx
from jaxcore.models import ltx_transformer
from tests.support.tiny_ltx import build_ltx_pipeline

TOLERANCE = 1e-4
STEPS = 4
LENGTH = 64
PROMPTS = ["a red circle on a white background", "blue square"]
NEGATIVE = ["dark background", "green"]
SEEDS = (3, 4)


@pytest.fixture(scope="module")
def cond_dir(tmp_path_factory):
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx_cond"), seed=5, condition=True)


@pytest.fixture(scope="module")
def pipes(cond_dir):
    from diffusers import LTXConditionPipeline

    return load_pipeline(cond_dir), LTXConditionPipeline.from_pretrained(cond_dir)


def _image(seed: int, size=(40, 48)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def _torch_noise(pipe, size, rows: int, seed: int) -> np.ndarray:
    """diffusers' initial latents: the generator's first draw."""
    shape = (rows, *pipe.latent_shape(*size))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).numpy()


def _ours(pipe, size, guidance, conditions, latents, frame_rate=25.0, noise_scale=0.0):
    height, width, frames = size
    rows = latents.shape[0]
    micro = [
        {
            "frame_rate": frame_rate,
            "decode_timestep": 0.0,
            "decode_noise_scale": 0.0,
            "image_cond_noise_scale": noise_scale,
            "seed": seed,
        }
        for seed in SEEDS[:rows]
    ]
    guidances = [pipe.guidance(guidance, 1.0, None, 0.0)] * rows
    cond, uncond, scales = pipe.conditioning(
        PROMPTS[:rows], NEGATIVE[:rows], guidances, LENGTH, size=size, micro_conditioning=micro
    )
    encoded = pipe.family.encode_conditions(pipe, [conditions] * rows, height, width, frames)
    cond.update(encoded)
    if uncond is not None:
        uncond.update(encoded)
    z = pipe.sample(latents, cond, uncond, num_inference_steps=STEPS, cfg_scale=scales)
    return np.asarray(pipe.decode(z, cond))


def _diffusers(torch_pipe, size, guidance, conditions, seed, rows, frame_rate=25):
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition

    height, width, frames = size
    return torch_pipe(
        conditions=[
            LTXVideoCondition(
                image=c.image,
                video=None if c.video is None else list(c.video),
                frame_index=c.frame_index,
                strength=c.strength,
            )
            for c in conditions
        ],
        prompt=PROMPTS[:rows],
        negative_prompt=NEGATIVE[:rows],
        height=height,
        width=width,
        num_frames=frames,
        frame_rate=frame_rate,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        image_cond_noise_scale=0.0,
        generator=torch.Generator().manual_seed(seed),
        decode_timestep=0.0,
        decode_noise_scale=0.0,
        max_sequence_length=LENGTH,
        output_type="np",
    ).frames


def test_recognised_with_its_defaults(cond_dir, pipes):
    family = families.for_pipeline(cond_dir)
    configs = family.component_configs(cond_dir)
    assert family.name == "ltx" and configs["pipeline"].frame_conditions
    assert family.image_inputs(configs).image == "none"
    defaults = family.sampling_defaults(configs)
    assert defaults["max_sequence_length"] == 256
    assert defaults["image_cond_noise_scale"] == 0.15
    pipe, _ = pipes
    with pytest.raises(families.FamilyError, match="guidance_rescale=0.5: not built"):
        pipe.guidance(3.0, 1.0, None, 0.5)


@pytest.mark.parametrize("steps", [1, 4, 7, 30])
def test_schedule_equals_the_pipelines(steps):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx.pipeline_ltx_condition import (
        linear_quadratic_schedule,
        retrieve_timesteps,
    )

    scheduler = FlowMatchEulerDiscreteScheduler()
    timesteps, _ = retrieve_timesteps(
        scheduler, steps, "cpu", linear_quadratic_schedule(steps) * 1000
    )
    sigmas, ours = ltx.condition_schedule(steps)
    np.testing.assert_array_equal(ours, timesteps.numpy())
    np.testing.assert_array_equal(sigmas, scheduler.sigmas.numpy())


def test_one_image_at_frame_0_matches_diffusers(pipes):
    pipe, torch_pipe = pipes
    size, seed = (32, 64, 9), 11
    conditions = [ltx.LTXCondition(image=_image(0), frame_index=0, strength=1.0)]
    latents = _torch_noise(pipe, size, 2, seed)
    ours = _ours(pipe, size, 3.0, conditions, latents)
    theirs = _diffusers(torch_pipe, size, 3.0, conditions, seed, 2)
    assert ours.shape == theirs.shape == (2, 9, 32, 64, 3)
    error = float(np.abs(ours - theirs).max())
    print(f"max |diff| {error:.2e}")
    assert error <= TOLERANCE, error


def test_image_and_video_at_two_frames_match_diffusers(pipes):
    """An image at frame 0 with strength 0.6 (blended, frozen for the first steps), a 9-frame
    video at frame 4 (its first two latent frames extra tokens, the third blended into latent
    frame 3), CFG, frame rate 24. One prompt: diffusers encodes a condition as a batch of one,
    so its extra tokens fit a batch of one prompt only (``torch.cat`` fails for more)."""
    pipe, torch_pipe = pipes
    size, seed = (32, 32, 17), 12
    video = [_image(10 + i, (32, 36)) for i in range(9)]
    conditions = [
        ltx.LTXCondition(image=_image(1), frame_index=0, strength=0.6),
        ltx.LTXCondition(video=video, frame_index=4, strength=1.0),
    ]
    latents = _torch_noise(pipe, size, 1, seed)
    ours = _ours(pipe, size, 3.0, conditions, latents, frame_rate=24.0)
    theirs = _diffusers(torch_pipe, size, 3.0, conditions, seed, 1, frame_rate=24)
    assert ours.shape == theirs.shape == (1, 17, 32, 32, 3)
    error = float(np.abs(ours - theirs).max())
    print(f"max |diff| {error:.2e}")
    assert error <= TOLERANCE, error


def test_image_cond_noise_comes_from_the_seed(pipes):
    """image_cond_noise_scale > 0 changes the render, the same way for the same seed; an extra
    token with strength < 1 draws its noise from the seed too."""
    pipe, _ = pipes
    size = (32, 32, 9)
    conditions = [
        ltx.LTXCondition(image=_image(2), frame_index=0),
        ltx.LTXCondition(image=_image(3), frame_index=8, strength=0.5),
    ]
    latents = _torch_noise(pipe, size, 1, 0)
    quiet = _ours(pipe, size, 1.0, conditions, latents)
    noisy = _ours(pipe, size, 1.0, conditions, latents, noise_scale=0.5)
    again = _ours(pipe, size, 1.0, conditions, latents, noise_scale=0.5)
    np.testing.assert_array_equal(noisy, again)
    assert float(np.abs(noisy - quiet).max()) > 1e-3
    assert np.isfinite(noisy).all()


def test_refusals(cond_dir, pipes, tmp_path):
    pipe, _ = pipes
    with pytest.raises(families.FamilyError, match="overlap"):
        pipe.family.encode_conditions(
            pipe,
            [[ltx.LTXCondition(image=_image(0)), ltx.LTXCondition(image=_image(1))]],
            32,
            32,
            9,
        )
    with pytest.raises(ValueError, match="exactly one of image and video"):
        ltx.LTXCondition()
    with pytest.raises(ValueError, match="strength=2"):
        ltx.LTXCondition(image=_image(0), strength=2)
    # a dynamically shifted scheduler: diffusers' pipeline passes no mu
    config = json.loads((cond_dir / "scheduler" / "scheduler_config.json").read_text())
    shifted = type(pipe.scheduler_config)({**config, "use_dynamic_shifting": True})
    fake = type("P", (), {"scheduler_config": shifted, "source": "x", "configs": pipe.configs})
    with pytest.raises(families.FamilyError, match="unshifted scheduler"):
        pipe.family.make_schedule(fake, "flow_euler", 4, 1.0, (1, 8, 3, 4, 4))


def test_condition_ids_are_the_pipelines():
    """The extra tokens' ids: ``_prepare_video_ids`` + ``_scale_video_ids`` at their index."""
    from diffusers import LTXConditionPipeline

    ids = LTXConditionPipeline._prepare_video_ids(1, 2, 3, 4)
    theirs = LTXConditionPipeline._scale_video_ids(ids, 8, 4, frame_index=5).float().numpy()
    ours = ltx_transformer.condition_video_coords(
        1,
        2,
        3,
        4,
        1.0,
        vae_temporal_compression_ratio=4,
        vae_spatial_compression_ratio=8,
        frame_index=5,
    )
    np.testing.assert_array_equal(ours, theirs)


def test_generate_renders_a_prompt_files_conditions(cond_dir, pipes, tmp_path):
    """``difforge generate``: a line's ``conditions`` (a PNG at frame 0 with strength 0.7, a
    ``.npy`` video at frame 4) render as diffusers renders them from the line's latents; a
    second line (only the PNG, the default per-step noise) renders beside it."""
    from pipelines import cli
    from tests.stages.test_ltx_generate import REPO, _array

    _, torch_pipe = pipes
    size, seed = (32, 32, 17), 13
    _image(7, (36, 40)).save(tmp_path / "first.png")
    frames = np.random.default_rng(8).integers(0, 256, (9, 32, 36, 3), dtype=np.uint8)
    np.save(tmp_path / "clip.npy", frames.astype(np.float32) / 255.0)
    noise = torch.randn((1, 8, 5, 4, 4), generator=torch.Generator().manual_seed(seed)).numpy()
    np.save(tmp_path / "noise.npy", noise[0])
    line = {
        "id": "framed",
        "prompt": PROMPTS[0],
        "negative_prompt": NEGATIVE[0],
        "latents": "noise.npy",
        "guidance_scale": 3.0,
        "image_cond_noise_scale": 0.0,
        "conditions": [
            {"image": "first.png", "strength": 0.7},
            {"video": "clip.npy", "frame_index": 4},
        ],
    }
    plain = {  # no extra frames, the default image_cond_noise_scale (0.15), no CFG
        "id": "first-only",
        "prompt": PROMPTS[1],
        "guidance_scale": 1.0,
        "conditions": [{"image": "first.png"}],
    }
    (tmp_path / "prompts.jsonl").write_text(json.dumps(line) + "\n" + json.dumps(plain) + "\n")
    out = tmp_path / "render"
    height, width, num_frames = size
    code = cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={cond_dir}",
            f"prompt_file={tmp_path / 'prompts.jsonl'}",
            f"output_dir={out}",
            f"num_inference_steps={STEPS}",
            f"max_sequence_length={LENGTH}",
            f"height={height}",
            f"width={width}",
            f"num_frames={num_frames}",
            "save_arrays=true",
            "-q",
        ]
    )
    assert code == 0
    record = json.loads((out / "records" / "framed.json").read_text())
    assert record["params"]["conditions"][1]["frame_index"] == 4
    assert record["params"]["image_cond_noise_scale"] == 0.0
    other = _array(out, "first-only")
    assert other.shape == (17, 32, 32, 3) and np.isfinite(other).all()
    conditions = [
        ltx.LTXCondition(image=Image.open(tmp_path / "first.png"), strength=0.7),
        ltx.LTXCondition(video=[Image.fromarray(f) for f in frames], frame_index=4),
    ]
    theirs = _diffusers(torch_pipe, size, 3.0, conditions, seed, 1)[0]
    ours = _array(out, "framed")
    assert ours.shape == theirs.shape == (17, 32, 32, 3)
    error = float(np.abs(ours - theirs).max())
    print(f"max |diff| {error:.2e}")
    assert error <= TOLERANCE, error


def test_prompt_file_conditions_are_checked():
    """``conditions`` parse into the spec (paths beside the prompt file) and are refused by a
    model whose family takes none, or when malformed, naming the line."""
    from stages.common.errors import StageInputError
    from stages.generate.config import SamplingSection
    from stages.generate.prompts import parse_prompts

    defaults = {
        "height": 32,
        "width": 32,
        "num_frames": 9,
        "num_inference_steps": 2,
        "guidance_scale": 3.0,
    }
    condition_model = {**defaults, "image_cond_noise_scale": 0.15}
    line = {"prompt": "p", "conditions": [{"video": "v.npy", "frame_index": 8, "strength": 0.5}]}
    (spec,) = parse_prompts("/d/p.jsonl", [json.dumps(line)], SamplingSection(), condition_model)
    assert spec.conditions == (("video", "/d/v.npy", 8, 0.5),)
    with pytest.raises(StageInputError, match="line 1: conditions are for LTXConditionPipeline"):
        parse_prompts("/d/p.jsonl", [json.dumps(line)], SamplingSection(), {**defaults})
    for bad, message in (
        ([{"image": "a.png", "video": "b.npy"}], "exactly one of image and video"),
        ([{"image": "a.png", "strength": 2}], r"strength must be in \[0, 1\]"),
        ([{"image": "a.png", "frame_index": -1}], "frame_index must be an integer >= 0"),
        ([], "non-empty list"),
    ):
        with pytest.raises(StageInputError, match=message):
            parse_prompts(
                "/d/p.jsonl",
                [json.dumps({"prompt": "p", "conditions": bad})],
                SamplingSection(),
                condition_model,
            )
