"""SD / SDXL UNet LoRAs vs diffusers' ``load_lora_weights``: a diffusers/PEFT file and kohya
files (SD 1.x/2.x diffusers-style names; SDXL's SGM ``input_blocks`` / ``middle_block`` /
``output_blocks`` / ``label_emb`` names, with alphas), each on every Linear and every
convolution of the UNet (LoCon: resnets, samplers, ``conv_in`` / ``conv_out``), render what
diffusers renders with the same file, within 1e-4 on [0, 1] pixels; what has no place (a
text-encoder key) is reported, not dropped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxcore import weights
from jaxcore.families import load_pipeline
from jaxcore.lora import sd as sd_lora
from jaxcore.lora.base import LoraError
from jaxcore.sampling import initial_latents
from tests.support.tiny_sd import build_sd_pipeline, build_sdxl_pipeline, random_unet_lora

TOLERANCE = 1e-4


def _render(directory, lora_file, pipeline_cls, xl: bool) -> tuple[np.ndarray, np.ndarray]:
    import torch
    from diffusers import EulerDiscreteScheduler

    ours_pipe = load_pipeline(directory)
    ours_pipe.apply_loras([(str(lora_file), 1.0)])
    shape = ours_pipe.latent_shape(16, 16, 1)
    latents = initial_latents(0, shape)[None]
    guidance = ours_pipe.guidance(1.0)
    cond, uncond, scales = ours_pipe.conditioning(
        ["a red circle"], [""], [guidance], 77, size=(16, 16, 1)
    )
    z = ours_pipe.sample(
        latents, cond, uncond, num_inference_steps=3, cfg_scale=scales, scheduler="euler"
    )
    ours = np.asarray(ours_pipe.decode(z))[0, 0]
    reference = pipeline_cls.from_pretrained(directory)
    reference.scheduler = EulerDiscreteScheduler.from_config(reference.scheduler.config)
    reference.load_lora_weights(str(lora_file))
    theirs = reference(
        prompt="a red circle",
        height=16,
        width=16,
        num_inference_steps=3,
        guidance_scale=1.0,
        latents=torch.from_numpy(latents),
        output_type="np",
    ).images[0]
    return ours, theirs


@pytest.mark.parametrize(("xl", "layout"), [(False, "peft"), (False, "kohya"), (True, "kohya_sgm")])
def test_unet_loras_match_diffusers(tmp_path, xl, layout):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    build = build_sdxl_pipeline if xl else build_sd_pipeline
    directory = build(tmp_path / "model", seed=2)
    pipe = load_pipeline(directory)
    lora = tmp_path / "lora.safetensors"
    weights.save_safetensors(random_unet_lora(pipe, layout, seed=3), lora)
    converted = sd_lora.to_diffusers(weights_of(lora), pipe.denoiser.config, "test")
    assert converted.unmatched == () and converted.layers
    cls = StableDiffusionXLPipeline if xl else StableDiffusionPipeline
    ours, theirs = _render(directory, lora, cls, xl)
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0)
    plain = load_pipeline(directory)
    latents = initial_latents(0, plain.latent_shape(16, 16, 1))[None]
    cond, _, _ = plain.conditioning(
        ["a red circle"], [""], [plain.guidance(1.0)], 77, size=(16, 16, 1)
    )
    base = np.asarray(
        plain.decode(plain.sample(latents, cond, num_inference_steps=3, scheduler="euler"))
    )[0, 0]
    assert np.abs(base - ours).max() > 1e-3  # the LoRA changed the render


def weights_of(path: Path) -> dict[str, np.ndarray]:
    from jaxcore.lora.base import read_lora_file

    return read_lora_file(path)


def test_text_encoder_keys_are_reported_and_bad_pairs_named(tmp_path):
    directory = build_sd_pipeline(tmp_path / "model", seed=2)
    pipe = load_pipeline(directory)
    tensors = random_unet_lora(pipe, "kohya", seed=1)
    tensors["lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"] = np.zeros(
        (1, 8), np.float32
    )
    converted = sd_lora.to_diffusers(tensors, pipe.denoiser.config, "x.safetensors")
    assert converted.unmatched == ("lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight",)
    broken = {k: v for k, v in tensors.items() if not k.endswith("lora_up.weight")}
    with pytest.raises(LoraError, match="x.safetensors: .*has no matching"):
        sd_lora.to_diffusers(broken, pipe.denoiser.config, "x.safetensors")


def test_kohya_alphas_scale_each_layer(tmp_path):
    """alpha / rank per layer, as sd-scripts defines it (and ComfyUI / A1111 apply it).
    diffusers 0.42 does not match the per-layer alphas of a kohya SD file's attention layers
    (its PEFT alpha_pattern keys use other names; it warns) and gives them the file's most
    common alpha, so the parity test above uses one rank and one alpha per file."""
    directory = build_sd_pipeline(tmp_path / "model", seed=2)
    config = load_pipeline(directory).denoiser.config
    pipe = load_pipeline(directory)
    half = sd_lora.to_diffusers(random_unet_lora(pipe, "kohya", 3, 0.5), config, "half")
    full = sd_lora.to_diffusers(random_unet_lora(pipe, "kohya", 3, 1.0), config, "full")
    assert set(half.layers) == set(full.layers)
    for module, layer in half.layers.items():
        np.testing.assert_allclose(layer.delta(), 0.5 * full.layers[module].delta(), rtol=1e-6)
