"""SD / SDXL UNet LoRAs vs diffusers' ``load_lora_weights``: a diffusers/PEFT file and kohya
files (SD 1.x/2.x diffusers-style names; SDXL's SGM ``input_blocks`` / ``middle_block`` /
``output_blocks`` names, with alphas) render what diffusers renders with the same file, within
1e-4 on [0, 1] pixels; what has no Linear form (a text-encoder key) is reported, not dropped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from jaxcore import weights
from jaxcore.lora import sd as sd_lora
from jaxcore.lora.base import LoraError
from jaxcore.pipeline import load_pipeline
from jaxcore.sampling import initial_latents
from tests.support.tiny_sd import build_sd_pipeline, build_sdxl_pipeline

TOLERANCE = 1e-4


def _lora_tensors(
    pipe, layout: str, seed: int, alpha_per_rank: float = 1.0
) -> dict[str, np.ndarray]:
    """A random LoRA on every Linear of the UNet in one key layout; kohya layouts carry
    ``alpha = alpha_per_rank * rank`` (the scale)."""
    rng = np.random.default_rng(seed)
    config = pipe.denoiser.config
    layers_per_block = config.layers_per_block
    out = {}
    params_map = pipe.family.lora_weight_map(config)
    shapes = {}
    from flax.core import meta

    from jaxcore.lora.merge import _get, _torch_shape

    params = meta.unbox(pipe.denoiser_params)
    for path, (key, transform) in params_map.items():
        shapes[key] = _torch_shape(transform, _get(params, path).shape)
    for i, module in enumerate(sorted(sd_lora.linear_modules(config))):
        out_features, in_features = shapes[f"{module}.weight"]
        # kohya files: one rank (diffusers applies the file's most common alpha to its
        # attention layers, see test_kohya_alphas_scale_each_layer); PEFT files: ranks 1-3
        rank = 1 + i % 3 if layout == "peft" else 2
        down = (rng.standard_normal((rank, in_features)) * 0.2).astype(np.float32)
        up = (rng.standard_normal((out_features, rank)) * 0.2).astype(np.float32)
        if layout == "peft":
            out[f"unet.{module}.lora_A.weight"], out[f"unet.{module}.lora_B.weight"] = down, up
            continue
        name = module
        if layout == "kohya_sgm":
            name = sd_lora._diffusers_to_sgm(module, layers_per_block)
            if name is None:  # outside the attention blocks: SGM files name them otherwise
                continue
        stem = "lora_unet_" + name.replace(".", "_")
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down, up
        out[f"{stem}.alpha"] = np.asarray(rank * alpha_per_rank, np.float32)
    return out


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
    weights.save_safetensors(_lora_tensors(pipe, layout, seed=3), lora)
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
    tensors = _lora_tensors(pipe, "kohya", seed=1)
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
    half = sd_lora.to_diffusers(_lora_tensors(pipe, "kohya", 3, 0.5), config, "half")
    full = sd_lora.to_diffusers(_lora_tensors(pipe, "kohya", 3, 1.0), config, "full")
    assert set(half.layers) == set(full.layers)
    for module, layer in half.layers.items():
        np.testing.assert_allclose(layer.delta(), 0.5 * full.layers[module].delta(), rtol=1e-6)
