"""WanPipelineJax vs diffusers WanPipeline on a tiny random-init pipeline (fp32, CPU).

The pipeline directory is written by ``build_tiny_wan_pipeline`` without torch; diffusers'
``WanPipeline.from_pretrained`` loads the same directory, and both render the same prompts from
the same initial latents. Reached: max |diff| ~2.3e-6 on [0, 1] pixels (with and without CFG);
asserted at 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore import families
from jaxcore.families import load_pipeline
from jaxcore.pipeline import Pipeline
from jaxcore.sampling import initial_latents
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from tests.support.encoder_calls import record_encoder_calls

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4
PROMPTS = ["a red circle", "blue square moving left"]
NEGATIVE = ["dark background", ""]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # Larger output scale: random-init velocities are tiny, which would make guidance invisible.
    return build_tiny_wan_pipeline(
        tmp_path_factory.mktemp("tiny_wan"), seed=1, transformer_output_scale=20.0
    )


@pytest.fixture(scope="module")
def jax_pipe(tiny_dir):
    pipe = load_pipeline(tiny_dir)
    assert isinstance(pipe, Pipeline) and pipe.family.name == "wan"
    return pipe


@pytest.fixture(scope="module")
def torch_pipe(tiny_dir):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(tiny_dir)


def test_diffusers_loads_the_tiny_pipeline_with_our_weights(tiny_dir, torch_pipe):
    from safetensors.numpy import load_file

    assert type(torch_pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    assert torch_pipe.scheduler.config.use_flow_sigmas
    ours = load_file(tiny_dir / "transformer/diffusion_pytorch_model.safetensors")
    theirs = {k: v.numpy() for k, v in torch_pipe.transformer.state_dict().items()}
    assert set(ours) == set(theirs)
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    vae = load_file(tiny_dir / "vae/diffusion_pytorch_model.safetensors")
    vae_theirs = torch_pipe.vae.state_dict()
    assert set(vae) == set(vae_theirs)
    for key in vae:
        np.testing.assert_array_equal(vae[key], vae_theirs[key].numpy(), err_msg=key)
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"


@pytest.mark.parametrize(("guidance", "frames"), [(1.0, 1), (4.0, 5)])
def test_matches_diffusers_wan_pipeline(jax_pipe, torch_pipe, guidance, frames):
    import torch

    # The tiny VAE compresses 2x in space and time (one downsampling level).
    shape = jax_pipe.latent_shape(16, 16, frames)
    assert shape == (4, (frames - 1) // 2 + 1, 8, 8)
    latents = np.stack([initial_latents(s, shape) for s in (3, 4)])
    guidances = [jax_pipe.guidance(guidance)] * 2
    cond, uncond, scales = jax_pipe.conditioning(PROMPTS, NEGATIVE, guidances, 512)
    assert (uncond is None) == (guidance <= 1)
    z = jax_pipe.sample(latents, cond, uncond, num_inference_steps=3, cfg_scale=scales)
    ours = np.asarray(jax_pipe.decode(z))
    ref = torch_pipe(
        prompt=PROMPTS,
        negative_prompt=NEGATIVE,
        height=16,
        width=16,
        num_frames=frames,
        num_inference_steps=3,
        guidance_scale=guidance,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).frames
    assert ours.shape == ref.shape == (2, frames, 16, 16, 3)
    np.testing.assert_allclose(ours, ref, atol=TOLERANCE, rtol=0)


def test_guidance_and_prompts_change_the_output(jax_pipe):
    """The parity test above would pass vacuously if nothing depended on text or guidance."""
    shape = jax_pipe.latent_shape(16, 16, 1)
    latents = np.stack([initial_latents(5, shape)] * 2)
    cond = jax_pipe.encode_prompts(PROMPTS, 512)
    uncond = jax_pipe.encode_prompts(NEGATIVE, 512)
    plain = np.asarray(jax_pipe.sample(latents, cond, uncond, num_inference_steps=2, cfg_scale=1))
    guided = np.asarray(jax_pipe.sample(latents, cond, uncond, num_inference_steps=2, cfg_scale=6))
    assert np.abs(plain[0] - plain[1]).max() > 1e-3  # prompt matters
    assert np.abs(plain - guided).max() > 1e-3  # guidance matters


def test_prompt_encodings_are_reused_and_equal_encoding_each_text_alone(tiny_dir, monkeypatch):
    from jaxcore.pipeline import ENCODE_BATCH, PromptEncodings

    pipe = load_pipeline(tiny_dir)  # its own memo
    encode = pipe.family.encode_prompts
    calls = record_encoder_calls(pipe, monkeypatch)
    texts = ["a red circle", "blue square moving left", "", "a red circle"]
    # rows equal each text encoded alone up to float rounding (batch shapes differ): values are
    # O(1), reached ~1e-6, asserted at 1e-5
    first = pipe.encode_prompts(texts, 512)["encoder_hidden_states"]
    # three distinct texts in one call, padded to 4 rows with the last
    assert calls == [["a red circle", "blue square moving left", "", ""]]
    for text, row in zip(texts, first, strict=True):
        alone = encode(pipe, [text], 512)["encoder_hidden_states"][0]
        np.testing.assert_allclose(row, alone, atol=1e-5, rtol=0, err_msg=text)
    assert np.abs(first[0] - first[1]).max() > 1e-3  # different texts, different rows
    np.testing.assert_array_equal(
        pipe.encode_prompts(texts[::-1], 512)["encoder_hidden_states"], first[::-1]
    )
    assert len(calls) == 1  # all found
    pipe.encode_prompts(["a red circle"], 64)  # another max_sequence_length is another key
    assert len(calls) == 2

    many = [f"prompt {i}" for i in range(ENCODE_BATCH + 3)]
    assert pipe.missing_encodings(many + ["a red circle"], 512) == many
    pipe.prefetch_prompts(many, 512)
    assert [len(c) for c in calls[2:]] == [ENCODE_BATCH, 4]
    pipe.encode_prompts(many[-5:], 512)
    assert len(calls) == 4 and pipe.missing_encodings(many[-5:], 512) == []

    # a batch with more distinct texts than the memo holds still gets every row right
    pipe.encodings = PromptEncodings(capacity=2)
    rows = pipe.encode_prompts(many[:5], 512)["encoder_hidden_states"]
    assert len(pipe.encodings._rows) == 2
    for text, row in zip(many[:5], rows, strict=True):
        alone = encode(pipe, [text], 512)["encoder_hidden_states"][0]
        np.testing.assert_allclose(row, alone, atol=1e-5, rtol=0, err_msg=text)


def test_initial_latents_depend_on_seed_only():
    a = initial_latents(11, (4, 2, 2, 2))
    np.testing.assert_array_equal(a, initial_latents(11, (4, 2, 2, 2)))
    assert a.dtype == np.float32
    assert not np.array_equal(a, initial_latents(12, (4, 2, 2, 2)))


def test_latent_shape_and_geometry_of_the_real_wan_configs():
    from jaxcore.model_configs import read_model_yaml

    family, configs = read_model_yaml(REPO / "configs/models/wan2.1_t2v_14b.yml")
    assert family.latent_shape(configs, 480, 832, 81) == (16, 21, 60, 104)
    geometry = family.geometry(configs)
    assert (geometry.spatial_multiple, geometry.temporal_multiple) == (16, 4)
    geometry.check(480, 832, 81)
    with pytest.raises(ValueError, match="height must be a positive multiple of 16"):
        geometry.check(472, 832, 81)
    with pytest.raises(ValueError, match="num_frames must be 1, 5, 9"):
        geometry.check(480, 832, 80)


def test_flow_euler_sampler_runs(jax_pipe):
    shape = jax_pipe.latent_shape(16, 16, 1)
    latents = initial_latents(0, shape)[None]
    cond = jax_pipe.encode_prompts(PROMPTS[:1], 16)
    z = jax_pipe.sample(latents, cond, None, num_inference_steps=2, scheduler="flow_euler")
    assert z.shape == latents.shape and np.isfinite(np.asarray(z)).all()


def test_missing_component_is_named(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(families.FamilyError, match="no transformer/config.json"):
        load_pipeline(tmp_path)
    with pytest.raises(families.FamilyError, match="does not exist"):
        load_pipeline(tmp_path / "nope")


def test_unknown_pipeline_class_lists_the_supported_ones(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "NopePipeline"}))
    with pytest.raises(families.FamilyError, match=r"'NopePipeline' is not supported.*WanPipeline"):
        load_pipeline(tmp_path)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"boundary_ratio": 0.875}, "boundary_ratio=0.875 needs a transformer_2"),
        (
            {"boundary_ratio": 1.5, "transformer_2": ["diffusers", "WanTransformer3DModel"]},
            "boundary_ratio must be a number in",
        ),
    ],
)
def test_bad_two_expert_index_is_refused_by_name(tmp_path, entries, message):
    index = {"_class_name": "WanPipeline", **entries}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(families.FamilyError, match=message):
        families.for_pipeline(tmp_path)
