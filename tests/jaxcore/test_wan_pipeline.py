"""WanPipelineJax vs diffusers WanPipeline on a tiny random-init pipeline (fp32, CPU).

The pipeline directory is written by ``build_tiny_wan_pipeline`` without torch; diffusers'
``WanPipeline.from_pretrained`` loads the same directory, and both render the same prompts from
the same initial latents. Reached: max |diff| ~2.3e-6 on [0, 1] pixels (with and without CFG);
asserted at 1e-4.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxcore import wan_pipeline
from jaxcore.tiny_pipeline import build_tiny_wan_pipeline

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
    return wan_pipeline.load_wan_pipeline(tiny_dir)


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
    latents = np.stack([wan_pipeline.initial_latents(s, shape) for s in (3, 4)])
    negatives = NEGATIVE if guidance > 1 else None
    text, neg = jax_pipe.encode_prompts(PROMPTS, negatives, 512)
    z = jax_pipe.sample(latents, text, neg, num_inference_steps=3, guidance_scale=guidance)
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
    latents = np.stack([wan_pipeline.initial_latents(5, shape)] * 2)
    text, neg = jax_pipe.encode_prompts(PROMPTS, NEGATIVE, 512)
    plain = np.asarray(jax_pipe.sample(latents, text, neg, num_inference_steps=2, guidance_scale=1))
    guided = np.asarray(
        jax_pipe.sample(latents, text, neg, num_inference_steps=2, guidance_scale=6)
    )
    assert np.abs(plain[0] - plain[1]).max() > 1e-3  # prompt matters
    assert np.abs(plain - guided).max() > 1e-3  # guidance matters


def test_initial_latents_depend_on_seed_only():
    a = wan_pipeline.initial_latents(11, (4, 2, 2, 2))
    np.testing.assert_array_equal(a, wan_pipeline.initial_latents(11, (4, 2, 2, 2)))
    assert a.dtype == np.float32
    assert not np.array_equal(a, wan_pipeline.initial_latents(12, (4, 2, 2, 2)))
    assert wan_pipeline.latent_shape(16, 480, 832, 81) == (16, 21, 60, 104)


def test_flow_euler_sampler_runs(jax_pipe):
    shape = jax_pipe.latent_shape(16, 16, 1)
    latents = wan_pipeline.initial_latents(0, shape)[None]
    text, _ = jax_pipe.encode_prompts(PROMPTS[:1], None, 16)
    z = jax_pipe.sample(
        latents, text, None, num_inference_steps=2, guidance_scale=1, scheduler="flow_euler"
    )
    assert z.shape == latents.shape and np.isfinite(np.asarray(z)).all()


def test_missing_component_is_named(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    with pytest.raises(wan_pipeline.PipelineError, match="missing component"):
        wan_pipeline.load_wan_pipeline(tmp_path)
    with pytest.raises(wan_pipeline.PipelineError, match="does not exist"):
        wan_pipeline.load_wan_pipeline(tmp_path / "nope")
