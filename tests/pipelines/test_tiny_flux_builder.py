"""The torch-free tiny Flux builder (``tiny:flux``) writes a pipeline diffusers loads as it is:
every component's state dict equals the files, and diffusers' ``FluxPipeline`` renders what the
Flux family renders from it (reached 5.4e-6 on [0, 1] pixels; asserted 1e-4)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxcore.families import load_pipeline
from pipelines.embedded.tiny import build_tiny_flux_pipeline


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    return build_tiny_flux_pipeline(tmp_path_factory.mktemp("tiny_flux"), seed=3)


def test_diffusers_loads_every_component_with_our_weights(tiny_flux):
    from diffusers import FluxPipeline
    from safetensors.numpy import load_file

    pipe = FluxPipeline.from_pretrained(tiny_flux)
    files = {
        "transformer": "diffusion_pytorch_model.safetensors",
        "vae": "diffusion_pytorch_model.safetensors",
        "text_encoder": "model.safetensors",
        "text_encoder_2": "model.safetensors",
    }
    for component, name in files.items():
        ours = load_file(tiny_flux / component / name)
        theirs = getattr(pipe, component).state_dict()
        # hub CLIP checkpoints (ours too) say text_model.*; transformers 5's module drops it
        ours = {k.removeprefix("text_model.") if k not in theirs else k: v for k, v in ours.items()}
        # transformers ties T5's encoder.embed_tokens to shared: stored once, as shared.weight
        tied = {k for k in theirs if k == "encoder.embed_tokens.weight"}
        assert set(ours) == set(theirs) - tied, component
        for key, value in ours.items():
            np.testing.assert_array_equal(value, theirs[key].numpy(), err_msg=f"{component} {key}")
    assert type(pipe.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert pipe.scheduler.config.use_dynamic_shifting


def test_diffusers_renders_what_the_family_renders(tiny_flux):
    import torch
    from diffusers import FluxPipeline

    from jaxcore.models.flux_transformer import pack_latents
    from jaxcore.sampling import initial_latents

    ours = load_pipeline(tiny_flux)
    prompts = ["a red circle", "a blue square on a white background"]
    shape = ours.latent_shape(16, 16, 1)
    latents = np.stack([initial_latents(s, shape) for s in (0, 1)])
    cond, _, _ = ours.conditioning(prompts, ["", ""], [ours.guidance(3.5)] * 2, 32)
    mine = np.asarray(ours.decode(ours.sample(latents, cond, num_inference_steps=2)))[:, 0]
    reference = FluxPipeline.from_pretrained(tiny_flux)(
        prompt=prompts,
        guidance_scale=3.5,
        height=16,
        width=16,
        num_inference_steps=2,
        latents=torch.from_numpy(np.asarray(pack_latents(latents))),
        max_sequence_length=32,
        output_type="np",
    ).images
    np.testing.assert_allclose(mine, reference, atol=1e-4, rtol=0)
