"""The distilled LTX-Video models' sampling (issue #48): a custom ``timesteps`` list, no guidance,
as diffusers' ``LTXConditionPipeline(timesteps=[...], guidance_scale=1.0)`` samples
``Lightricks/LTX-Video-0.9.7-distilled`` / ``0.9.8-13B-distilled``; and the distilled model's
YAML (configs/models/ltx_video_13b_0.9.7_distilled.yml).

diffusers 0.42.1: only ``LTXConditionPipeline`` takes ``timesteps=`` (it hands them to
``FlowMatchEulerDiscreteScheduler.set_timesteps(timesteps=...)`` with no ``mu``: timesteps as
given, sigmas ``t / 1000`` through the unshifted scheduler); ``LTXPipeline`` and
``LTXImageToVideoPipeline`` pass their own ``sigmas`` beside them and fail, so the family
refuses timesteps for those. On the tiny condition pipeline (tests/support/tiny_ltx.py), the
noise drawn with torch as diffusers' generator draws it, decode noise 0, no CFG: asserted max
|diff| <= 1e-4 on [0, 1] pixels (the first distilled list, 8 steps, 2 prompts; and through
``difforge generate`` from a prompt line's ``timesteps``); reached 1.7e-6 (2 prompts, 32 x 64),
1.5e-6 (a first frame at strength 0.8), 1.4e-6 (generate, the 5-step list). The schedule equals
diffusers' bit for bit.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from jaxcore import families
from jaxcore.families import load_pipeline, ltx
from tests.support.tiny_ltx import build_ltx_pipeline

TOLERANCE = 1e-4
LENGTH = 64
DISTILLED = [1000, 993, 987, 981, 975, 909, 725, 0.03]  # diffusers' docs: the first pass
UPSCALED = [1000, 909, 725, 421, 0]  # the docs' second pass (after latent upsampling)
PROMPTS = ["a red circle on a white background", "blue square"]
SEEDS = (3, 4)


@pytest.fixture(scope="module")
def cond_dir(tmp_path_factory):
    return build_ltx_pipeline(tmp_path_factory.mktemp("ltx_distilled"), seed=6, condition=True)


@pytest.fixture(scope="module")
def pipes(cond_dir):
    from diffusers import LTXConditionPipeline

    return load_pipeline(cond_dir), LTXConditionPipeline.from_pretrained(cond_dir)


def _torch_noise(pipe, size, rows: int, seed: int) -> np.ndarray:
    shape = (rows, *pipe.latent_shape(*size))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).numpy()


def _diffusers(torch_pipe, size, timesteps, seed, rows, conditions=None):
    height, width, frames = size
    return torch_pipe(
        conditions=conditions,
        prompt=PROMPTS[:rows],
        height=height,
        width=width,
        num_frames=frames,
        timesteps=timesteps,
        guidance_scale=1.0,
        image_cond_noise_scale=0.0,
        generator=torch.Generator().manual_seed(seed),
        decode_timestep=0.0,
        decode_noise_scale=0.0,
        max_sequence_length=LENGTH,
        output_type="np",
    ).frames


@pytest.mark.parametrize("timesteps", [DISTILLED, UPSCALED])
def test_custom_schedule_equals_the_schedulers(timesteps):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx.pipeline_ltx_condition import retrieve_timesteps

    scheduler = FlowMatchEulerDiscreteScheduler()  # 0.9.7's: the defaults
    theirs, steps = retrieve_timesteps(scheduler, None, "cpu", timesteps)
    sigmas, ours = ltx.custom_schedule(timesteps)
    assert steps == len(timesteps)
    np.testing.assert_array_equal(ours, theirs.numpy())
    np.testing.assert_array_equal(sigmas, scheduler.sigmas.numpy())


def test_distilled_timesteps_match_diffusers(pipes):
    pipe, torch_pipe = pipes
    size, seed = (32, 64, 9), 21
    latents = _torch_noise(pipe, size, 2, seed)
    micro = [
        {
            "frame_rate": 25.0,
            "decode_timestep": 0.0,
            "decode_noise_scale": 0.0,
            "image_cond_noise_scale": 0.0,
            "seed": s,
        }
        for s in SEEDS
    ]
    guidances = [pipe.guidance(1.0, 1.0, None, 0.0)] * 2
    cond, uncond, scales = pipe.conditioning(
        PROMPTS, ["", ""], guidances, LENGTH, size=size, micro_conditioning=micro
    )
    assert uncond is None
    z = pipe.sample(
        latents,
        cond,
        num_inference_steps=len(DISTILLED),
        cfg_scale=scales,
        timesteps=DISTILLED,
    )
    ours = np.asarray(pipe.decode(z, cond))
    theirs = _diffusers(torch_pipe, size, DISTILLED, seed, 2)
    assert ours.shape == theirs.shape == (2, 9, 32, 64, 3)
    error = float(np.abs(ours - theirs).max())
    print(f"max |diff| {error:.2e}")
    assert error <= TOLERANCE, error
    # the custom list is what was sampled: the default 8-step schedule renders otherwise
    default = np.asarray(pipe.decode(pipe.sample(latents, cond, num_inference_steps=8), cond))
    assert float(np.abs(default - ours).max()) > 1e-3


def test_distilled_timesteps_with_a_first_frame_match_diffusers(pipes):
    """An image at frame 0 (strength 0.8: its tokens frozen while ``t / 1000 >= 0.2``, so for
    the first steps of the distilled list) with the distilled timesteps, one prompt."""
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition
    from PIL import Image

    pipe, torch_pipe = pipes
    size, seed = (32, 32, 9), 23
    height, width, frames = size
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))
    latents = _torch_noise(pipe, size, 1, seed)
    micro = [
        {
            "frame_rate": 25.0,
            "decode_timestep": 0.0,
            "decode_noise_scale": 0.0,
            "image_cond_noise_scale": 0.0,
            "seed": 0,
        }
    ]
    guidances = [pipe.guidance(1.0, 1.0, None, 0.0)]
    cond, _, scales = pipe.conditioning(
        PROMPTS[:1], [""], guidances, LENGTH, size=size, micro_conditioning=micro
    )
    condition = ltx.LTXCondition(image=image, frame_index=0, strength=0.8)
    cond.update(pipe.family.encode_conditions(pipe, [[condition]], height, width, frames))
    z = pipe.sample(latents, cond, num_inference_steps=8, cfg_scale=scales, timesteps=DISTILLED)
    ours = np.asarray(pipe.decode(z, cond))
    theirs = _diffusers(
        torch_pipe, size, DISTILLED, seed, 1, [LTXVideoCondition(image=image, strength=0.8)]
    )
    assert ours.shape == theirs.shape == (1, 9, 32, 32, 3)
    error = float(np.abs(ours - theirs).max())
    print(f"max |diff| {error:.2e}")
    assert error <= TOLERANCE, error


def test_generate_renders_a_lines_timesteps(cond_dir, pipes, tmp_path):
    """``difforge generate``: a line's ``timesteps`` render as diffusers renders them from the
    line's latents; the record holds the list and the steps are its count."""
    from pipelines import cli
    from tests.stages.test_ltx_generate import REPO, _array

    pipe, torch_pipe = pipes
    size, seed = (32, 32, 9), 22
    noise = _torch_noise(pipe, size, 1, seed)
    np.save(tmp_path / "noise.npy", noise[0])
    line = {
        "id": "distilled",
        "prompt": PROMPTS[0],
        "latents": "noise.npy",
        "guidance_scale": 1.0,
        "image_cond_noise_scale": 0.0,
        "timesteps": UPSCALED,
    }
    (tmp_path / "prompts.jsonl").write_text(json.dumps(line) + "\n")
    out = tmp_path / "render"
    height, width, num_frames = size
    code = cli.main(
        [
            "generate",
            str(REPO / "configs/stages/generate.yml"),
            f"pretrained_model_name_or_path={cond_dir}",
            f"prompt_file={tmp_path / 'prompts.jsonl'}",
            f"output_dir={out}",
            f"max_sequence_length={LENGTH}",
            f"height={height}",
            f"width={width}",
            f"num_frames={num_frames}",
            "save_arrays=true",
            "-q",
        ]
    )
    assert code == 0
    record = json.loads((out / "records" / "distilled.json").read_text())
    assert record["params"]["timesteps"] == [float(t) for t in UPSCALED]
    assert record["params"]["num_inference_steps"] == len(UPSCALED)
    theirs = _diffusers(torch_pipe, size, UPSCALED, seed, 1)[0]
    ours = _array(out, "distilled")
    assert ours.shape == theirs.shape == (9, 32, 32, 3)
    error = float(np.abs(ours - theirs).max())
    print(f"max |diff| {error:.2e}")
    assert error <= TOLERANCE, error


def test_family_refusals(pipes, tmp_path):
    """Custom timesteps: an LTXPipeline model refuses them (diffusers' fails), a list that is
    not strictly decreasing or leaves [0, 1000] is refused, and the steps are its count."""
    pipe, _ = pipes
    shape = (1, 8, 2, 1, 1)
    with pytest.raises(families.FamilyError, match="strictly decreasing"):
        pipe.family.make_schedule(pipe, "flow_euler", 3, 1.0, shape, timesteps=[900, 950, 10])
    with pytest.raises(families.FamilyError, match=r"in \[0, 1000\]"):
        pipe.family.make_schedule(pipe, "flow_euler", 2, 1.0, shape, timesteps=[1200, 10])
    with pytest.raises(families.FamilyError, match="num_inference_steps=4 with 2 custom"):
        pipe.family.make_schedule(pipe, "flow_euler", 4, 1.0, shape, timesteps=[900, 10])
    t2v = type(
        "P",
        (),
        {
            "scheduler_config": pipe.scheduler_config,
            "source": "x",
            "configs": {**pipe.configs, "pipeline": ltx.LTXPipelineOptions()},
        },
    )
    with pytest.raises(families.FamilyError, match="LTXConditionPipeline model only"):
        pipe.family.make_schedule(t2v, "flow_euler", 2, 1.0, shape, timesteps=[900, 10])
    assert "timesteps" not in pipe.family.sampling_defaults(t2v.configs)
    assert pipe.family.sampling_defaults(pipe.configs)["timesteps"] is None


def test_prompt_file_timesteps_are_checked():
    """``timesteps`` parse into the spec (the steps their count, in the group key and the
    record) and are refused, naming the line, by a model that takes none (a non-LTX model's
    defaults, or LTXPipeline's) and when malformed."""
    from stages.common.errors import StageInputError
    from stages.generate.config import SamplingSection
    from stages.generate.prompts import parse_prompts

    defaults = {
        "height": 32,
        "width": 32,
        "num_frames": 9,
        "num_inference_steps": 50,
        "guidance_scale": 3.0,
    }
    distilled = {**defaults, "image_cond_noise_scale": 0.15, "timesteps": None}
    lines = [
        json.dumps({"prompt": "p", "timesteps": DISTILLED, "guidance_scale": 1.0}),
        json.dumps({"prompt": "q", "timesteps": UPSCALED, "guidance_scale": 1.0}),
        json.dumps({"prompt": "r", "guidance_scale": 1.0}),
    ]
    a, b, c = parse_prompts("/d/p.jsonl", lines, SamplingSection(), distilled)
    assert a.timesteps == tuple(float(t) for t in DISTILLED) and a.num_inference_steps == 8
    assert b.num_inference_steps == 5 and c.timesteps is None and c.num_inference_steps == 50
    assert len({a.group_key, b.group_key, c.group_key}) == 3
    assert a.params()["timesteps"] == list(a.timesteps) and "timesteps" not in c.params()
    # a non-LTX model (its defaults name no timesteps), and an LTXPipeline's
    wan = families.get("wan").sampling_defaults({})
    for model in (defaults, wan):
        with pytest.raises(StageInputError, match="line 1: timesteps are for models whose"):
            parse_prompts("/d/p.jsonl", lines[:1], SamplingSection(), model)
    for bad, message in (
        ([1000, 1000, 10], "strictly decreasing"),
        ([10, 500], "strictly decreasing"),
        ([1000.5, 10], r"in \[0, 1000\]"),
        ([900, -1], r"in \[0, 1000\]"),
        ([], "non-empty list of numbers"),
        ([900, "x"], "non-empty list of numbers"),
        (900, "non-empty list of numbers"),
    ):
        with pytest.raises(StageInputError, match=f"line 1: timesteps must .*{message}"):
            parse_prompts(
                "/d/p.jsonl",
                [json.dumps({"prompt": "p", "timesteps": bad})],
                SamplingSection(),
                distilled,
            )
    conflict = json.dumps({"prompt": "p", "timesteps": UPSCALED, "num_inference_steps": 8})
    with pytest.raises(StageInputError, match="line 1: num_inference_steps=8 with 5 timesteps"):
        parse_prompts("/d/p.jsonl", [conflict], SamplingSection(), distilled)


def test_distilled_yaml_counts_like_diffusers():
    """The distilled YAML's architecture built by diffusers on the meta device counts as ours
    does (the 13B 0.9.7 transformer and the 0.9.5 / 0.9.7 VAE)."""
    from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel

    from jaxcore.model_configs import read_model_yaml
    from jaxcore.models import ltx_transformer, ltx_vae, t5
    from tests.stages.test_ltx_generate import REPO

    path = REPO / "configs/models/ltx_video_13b_0.9.7_distilled.yml"
    family, configs = read_model_yaml(path)
    assert family.name == "ltx"
    with torch.device("meta"):
        transformer = LTXVideoTransformer3DModel(**configs["transformer"].to_dict())
        vae = AutoencoderKLLTXVideo(**configs["vae"].to_dict())
    assert sum(p.numel() for p in transformer.parameters()) == 13_042_569_344
    assert sum(p.numel() for p in vae.parameters()) == 1_246_913_522
    assert ltx_transformer.count_params(configs["transformer"]) == 13_042_569_344
    assert ltx_vae.count_params(configs["vae"]) == 1_246_913_522
    assert t5.count_params(configs["text_encoder"]) == 4_762_310_656
    text = path.read_text()
    assert "[1000, 993, 987, 981, 975, 909, 725, 0.03]" in text
    assert '"guidance_scale": 1.0' in text and '"decode_timestep": 0.05' in text
