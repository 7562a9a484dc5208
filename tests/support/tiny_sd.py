"""Tiny random-init diffusers ``StableDiffusionPipeline`` (SD 2.x-like) and
``StableDiffusionXLPipeline`` directories, built with diffusers/transformers (PyTorch) and written
with ``save_pretrained``: the reference the SD family is tested against.

Every parameter is perturbed (``p += 0.1 * randn``) so that a mis-mapped weight, a skipped norm
or a wrong bias changes the output. The tokenizers are the offline tiny CLIP byte-pair ones of
``pipelines.embedded.tokenizers``. Shapes are SD's in miniature: a 2-level VAE (2x), a 2-level UNet
with linear projections, 8-multiple image sizes (diffusers' check), CLIP text encoders of
SD 2's kind (gelu, last layer) and SDXL's (CLIP-L-like + a projected bigG-like, penultimate
layers) with ``text_time`` added conditioning.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

CLIP_MAX_LENGTH = 20
VAE = dict(
    block_out_channels=(8, 16),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=16,
)
SD_UNET = dict(  # SD 2.x-like: cross-attention down first, linear projections, heads per level
    block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    layers_per_block=1,
    attention_head_dim=(2, 4),
    norm_num_groups=8,
    cross_attention_dim=32,
    use_linear_projection=True,
    sample_size=8,
)
XL_UNET = dict(  # SDXL-like: plain first level, deeper transformers below, text_time
    block_out_channels=(32, 64),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    layers_per_block=1,
    transformer_layers_per_block=(1, 2),
    attention_head_dim=(2, 4),
    norm_num_groups=8,
    cross_attention_dim=40,  # 16 (text_encoder) + 24 (text_encoder_2)
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=12 + 6 * 8,  # text_encoder_2 projection_dim + 6 ids
    sample_size=8,
)
SD_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    hidden_act="gelu",  # OpenCLIP-H's
    max_position_embeddings=CLIP_MAX_LENGTH,
)
XL_CLIP = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=2,
    hidden_act="quick_gelu",  # CLIP-L's
    max_position_embeddings=CLIP_MAX_LENGTH,
)
XL_CLIP_2 = dict(
    hidden_size=24,
    intermediate_size=48,
    projection_dim=12,
    num_hidden_layers=3,
    num_attention_heads=3,
    hidden_act="gelu",  # OpenCLIP-bigG's
    max_position_embeddings=CLIP_MAX_LENGTH,
)
# stabilityai/stable-diffusion-2-base's scheduler: PNDM (PLMS), scaled-linear betas, leading
# spacing with offset 1; its saved config also carries DDIM's clip_sample=false
SD2_BASE_SCHEDULE = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    set_alpha_to_one=False,
    skip_prk_steps=True,
    steps_offset=1,
    prediction_type="epsilon",
)
SD2_BASE_EXTRA_KEYS = {"clip_sample": False}
# SD 2.1 768-v-like DDIM with the zero-terminal-SNR fix (trailing spacing)
V_ZERO_SNR_SCHEDULE = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    clip_sample=False,
    set_alpha_to_one=False,
    steps_offset=1,
    prediction_type="v_prediction",
    rescale_betas_zero_snr=True,
    timestep_spacing="trailing",
)
# SDXL base's Euler schedule, as a DPM++ 2M Karras config (diffusers' popular choice)
XL_SCHEDULE = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    steps_offset=1,
    timestep_spacing="leading",
    use_karras_sigmas=True,
    algorithm_type="dpmsolver++",
    solver_order=2,
)


def _perturbed(model, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.eval()


def _clip(tokenizer, config: dict, seed: int, projection: bool = False):
    import transformers

    clip_config = transformers.CLIPTextConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config,
    )
    cls = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
    return _perturbed(cls(clip_config), seed)


def _tokenizer(directory: Path, name: str):
    from pipelines.embedded.tokenizers import build_tiny_clip_tokenizer

    return build_tiny_clip_tokenizer(directory / f"_{name}", model_max_length=CLIP_MAX_LENGTH)


def _scheduler(kind: str, config: dict):
    import diffusers

    return getattr(diffusers, kind)(**config)


def _add_scheduler_keys(directory: Path, keys: dict | None) -> None:
    """Write keys the scheduler class does not take into its saved config, as released
    pipelines carry them (SD 2-base's PNDM config has DDIM's ``clip_sample: false``)."""
    if keys:
        path = directory / "scheduler" / "scheduler_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **keys}, indent=2))


def build_sd_pipeline(
    directory: str | Path,
    *,
    seed: int = 0,
    scheduler: str = "PNDMScheduler",
    schedule: dict | None = None,
    extra_scheduler_keys: dict | None = None,
    unet: dict | None = None,
    vae: dict | None = None,
) -> Path:
    """Write a tiny SD 2.x-like ``StableDiffusionPipeline`` into ``directory`` (SD 2-base's
    PNDM scheduler config by default); returns it."""
    import torch
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel

    directory = Path(directory)
    tokenizer = _tokenizer(directory, "tokenizer")
    torch.manual_seed(seed)
    pipe = StableDiffusionPipeline(
        unet=_perturbed(UNet2DConditionModel(**{**SD_UNET, **(unet or {})}), seed),
        vae=_perturbed(AutoencoderKL(**{**VAE, **(vae or {})}), seed + 1),
        text_encoder=_clip(tokenizer, SD_CLIP, seed + 2),
        tokenizer=tokenizer,
        scheduler=_scheduler(scheduler, schedule or SD2_BASE_SCHEDULE),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(directory)
    if schedule is None and extra_scheduler_keys is None:
        extra_scheduler_keys = SD2_BASE_EXTRA_KEYS
    _add_scheduler_keys(directory, extra_scheduler_keys)
    shutil.rmtree(directory / "_tokenizer")
    return directory


def build_sdxl_pipeline(
    directory: str | Path,
    *,
    seed: int = 0,
    scheduler: str = "DPMSolverMultistepScheduler",
    schedule: dict | None = None,
    unet: dict | None = None,
    vae: dict | None = None,
    force_zeros_for_empty_prompt: bool = True,
) -> Path:
    """Write a tiny SDXL-like ``StableDiffusionXLPipeline`` into ``directory``; returns it."""
    import torch
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel

    directory = Path(directory)
    tokenizer = _tokenizer(directory, "tokenizer")
    tokenizer_2 = _tokenizer(directory, "tokenizer_2")
    torch.manual_seed(seed)
    pipe = StableDiffusionXLPipeline(
        unet=_perturbed(UNet2DConditionModel(**{**XL_UNET, **(unet or {})}), seed),
        vae=_perturbed(
            AutoencoderKL(**{**VAE, "scaling_factor": 0.13025, **(vae or {})}), seed + 1
        ),
        text_encoder=_clip(tokenizer, XL_CLIP, seed + 2),
        text_encoder_2=_clip(tokenizer_2, XL_CLIP_2, seed + 3, projection=True),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        scheduler=_scheduler(scheduler, schedule or XL_SCHEDULE),
        force_zeros_for_empty_prompt=force_zeros_for_empty_prompt,
        add_watermarker=False,
    )
    pipe.save_pretrained(directory)
    shutil.rmtree(directory / "_tokenizer")
    shutil.rmtree(directory / "_tokenizer_2")
    return directory


def random_unet_lora(
    pipe, layout: str, seed: int, alpha_per_rank: float = 1.0
) -> dict[str, np.ndarray]:
    """A random LoRA on every Linear and Conv2d of the UNet in one key layout (convolutions as
    PEFT / LoCon save them: ``down`` a ``k x k`` conv to ``rank`` channels, ``up`` a 1x1 conv);
    kohya layouts carry ``alpha = alpha_per_rank * rank`` (the scale)."""
    rng = np.random.default_rng(seed)
    config = pipe.denoiser.config
    out = {}
    params_map = pipe.family.lora_weight_map(config)
    shapes = {}
    from flax.core import meta

    from jaxcore.lora import sd as sd_lora
    from jaxcore.lora.merge import _get, _torch_shape

    params = meta.unbox(pipe.denoiser_params)
    for path, (key, transform) in params_map.items():
        shapes[key] = _torch_shape(transform, _get(params, path).shape)
    for i, module in enumerate(sorted(sd_lora.lora_modules(config))):
        out_features, in_features, *kernel = shapes[f"{module}.weight"]
        # kohya files: one rank (diffusers applies the file's most common alpha to its
        # attention layers, see test_kohya_alphas_scale_each_layer); PEFT files: ranks 1-3
        rank = 1 + i % 3 if layout == "peft" else 2
        down = (rng.standard_normal((rank, in_features, *kernel)) * 0.2).astype(np.float32)
        up = (rng.standard_normal((out_features, rank, *[1] * len(kernel))) * 0.2).astype(
            np.float32
        )
        if layout == "peft":
            out[f"unet.{module}.lora_A.weight"], out[f"unet.{module}.lora_B.weight"] = down, up
            continue
        name = module
        if layout == "kohya_sgm":
            name = sd_lora.diffusers_to_sgm(module, config)
        stem = "lora_unet_" + name.replace(".", "_")
        out[f"{stem}.lora_down.weight"], out[f"{stem}.lora_up.weight"] = down, up
        out[f"{stem}.alpha"] = np.asarray(rank * alpha_per_rank, np.float32)
    return out


def controlnet_config(unet: dict, embedding=(8, 16)) -> dict:
    """A ControlNetModel config matching a tiny UNet config; ``embedding``: its control-image
    embedding's channels (one stride-2 conv per step after the first: the tiny VAE's 2x)."""
    keys = (
        "block_out_channels",
        "down_block_types",
        "layers_per_block",
        "transformer_layers_per_block",
        "attention_head_dim",
        "norm_num_groups",
        "cross_attention_dim",
        "use_linear_projection",
        "addition_embed_type",
        "addition_time_embed_dim",
        "projection_class_embeddings_input_dim",
    )
    config = {k: unet[k] for k in keys if k in unet}
    return {**config, "conditioning_embedding_out_channels": tuple(embedding)}


def build_controlnet_pipeline(
    directory: str | Path,
    *,
    xl: bool = False,
    count: int = 1,
    seed: int = 0,
    scheduler: str | None = None,
    schedule: dict | None = None,
    controlnet: dict | None = None,
    union: bool = False,
) -> Path:
    """A tiny ``StableDiffusionControlNetPipeline`` (``xl``: ``StableDiffusionXLControlNet
    Pipeline``) with ``count`` perturbed ControlNets (several: diffusers' MultiControlNetModel,
    saved as ``controlnet``, ``controlnet_1``, ...); the base is :func:`build_sd_pipeline` /
    :func:`build_sdxl_pipeline`'s with the same seed. ``union``: one SDXL
    ``ControlNetUnionModel`` (``StableDiffusionXLControlNetUnionPipeline``)."""
    import diffusers
    import torch
    from diffusers import ControlNetModel

    if union:
        return _build_union_pipeline(Path(directory), seed, scheduler, schedule)

    directory = Path(directory)
    base = directory / "_base"
    if xl:
        build_sdxl_pipeline(base, seed=seed, **_scheduler_kw(scheduler, schedule))
        cls, unet = diffusers.StableDiffusionXLControlNetPipeline, XL_UNET
    else:
        build_sd_pipeline(base, seed=seed, **_scheduler_kw(scheduler, schedule))
        cls, unet = diffusers.StableDiffusionControlNetPipeline, SD_UNET
    torch.manual_seed(seed + 10)
    nets = [
        _perturbed(ControlNetModel(**{**controlnet_config(unet), **(controlnet or {})}), seed + k)
        for k in range(count)
    ]
    pipe = cls.from_pretrained(
        base, controlnet=nets[0] if count == 1 else diffusers.MultiControlNetModel(nets)
    )
    pipe.save_pretrained(directory)
    shutil.rmtree(base)
    return directory


def _scheduler_kw(scheduler: str | None, schedule: dict | None) -> dict:
    kw = {}
    if scheduler is not None:
        kw["scheduler"] = scheduler
    if schedule is not None:
        kw["schedule"] = schedule
    return kw


UNION_TYPES = 4


def _build_union_pipeline(directory: Path, seed, scheduler, schedule) -> Path:
    import diffusers
    import torch

    base = directory / "_base"
    build_sdxl_pipeline(base, seed=seed, **_scheduler_kw(scheduler, schedule))
    torch.manual_seed(seed + 10)
    config = controlnet_config(XL_UNET)
    union = diffusers.ControlNetUnionModel(
        **config,
        num_control_type=UNION_TYPES,
        num_trans_channel=32,
        num_trans_head=2,
        num_trans_layer=1,
        num_proj_channel=32,
    )
    pipe = diffusers.StableDiffusionXLControlNetUnionPipeline.from_pretrained(
        base, controlnet=_perturbed(union, seed + 20)
    )
    pipe.save_pretrained(directory)
    shutil.rmtree(base)
    return directory
