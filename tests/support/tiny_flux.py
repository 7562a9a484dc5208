"""Tiny random-init diffusers ``FluxPipeline`` directories, built with diffusers/transformers
(PyTorch) and written with ``save_pretrained``: the reference the Flux family is tested against.

Every parameter is perturbed (``p += 0.1 * randn``) so that a mis-mapped weight, a skipped
norm or a wrong bias changes the output. The tokenizers are the offline tiny ones of
``pipelines.embedded.tokenizers`` (CLIP byte-pair for ``tokenizer``, T5 unigram for
``tokenizer_2``).
"""

from __future__ import annotations

from pathlib import Path

# A dev-like transformer: 16 packed channels (4 latent channels x 2 x 2), guidance embedding.
TRANSFORMER = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
VAE = dict(
    block_out_channels=(8, 16),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=4,
    sample_size=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.3611,
    shift_factor=0.1159,
)
CLIP = dict(  # hidden_size = the transformer's pooled_projection_dim
    hidden_size=24,
    intermediate_size=48,
    projection_dim=24,
    num_hidden_layers=2,
    num_attention_heads=3,
    max_position_embeddings=20,
    hidden_act="quick_gelu",
)
T5 = dict(  # d_model = the transformer's joint_attention_dim
    vocab_size=128,
    d_model=32,
    d_kv=8,
    d_ff=48,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=8,
    relative_attention_max_distance=16,
    feed_forward_proj="gated-gelu",
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)
# FLUX.1-dev's and FLUX.1-schnell's scheduler_config.json.
DEV_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
CLIP_MAX_LENGTH = 20


def _perturbed(model, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.eval()


def build_flux_pipeline(
    directory: str | Path,
    *,
    seed: int = 0,
    guidance_embeds: bool = True,
    scheduler: dict | None = None,
    transformer: dict | None = None,
    vae: dict | None = None,
) -> Path:
    """Write a tiny ``FluxPipeline`` (dev-like by default) into ``directory``; returns it.
    ``transformer`` / ``vae``: config entries replacing :data:`TRANSFORMER`'s / :data:`VAE`'s."""
    import torch
    import transformers
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )

    from pipelines.embedded.tokenizers import build_tiny_clip_tokenizer, build_tiny_tokenizer

    directory = Path(directory)
    clip_tokenizer = build_tiny_clip_tokenizer(
        directory / "_tokenizer", model_max_length=CLIP_MAX_LENGTH
    )
    t5_tokenizer = build_tiny_tokenizer(directory / "_tokenizer_2", vocab_size=T5["vocab_size"])
    torch.manual_seed(seed)
    config = {**TRANSFORMER, "guidance_embeds": guidance_embeds, **(transformer or {})}
    clip_config = transformers.CLIPTextConfig(
        vocab_size=len(clip_tokenizer),
        bos_token_id=clip_tokenizer.bos_token_id,
        eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id,
        **CLIP,
    )
    pipe = FluxPipeline(
        transformer=_perturbed(FluxTransformer2DModel(**config), seed),
        vae=_perturbed(AutoencoderKL(**{**VAE, **(vae or {})}), seed + 1),
        text_encoder=_perturbed(transformers.CLIPTextModel(clip_config), seed + 2),
        text_encoder_2=_perturbed(
            transformers.T5EncoderModel(transformers.T5Config(**T5)), seed + 3
        ),
        tokenizer=clip_tokenizer,
        tokenizer_2=t5_tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**(scheduler or DEV_SCHEDULER)),
    )
    pipe.save_pretrained(directory)
    import shutil

    shutil.rmtree(directory / "_tokenizer")
    shutil.rmtree(directory / "_tokenizer_2")
    return directory


# Tiny FluxControlNetModels fitting TRANSFORMER (a union one adds num_mode).
CONTROLNET = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
UNION_MODES = 3


def _tight_posterior(vae) -> None:
    """The VAE encoder's log-variance half of ``conv_out``'s bias at -60: diffusers clamps it
    to -30, so its posterior *sample* (the Flux ControlNet pipeline's ``retrieve_latents``) is
    the mean within std ~3e-7, and the mean (what difforge encodes) can match it."""
    import torch

    channels = vae.config.latent_channels
    with torch.no_grad():
        vae.encoder.conv_out.bias[channels:] = -60.0


def build_flux_controlnet_pipeline(
    directory: str | Path,
    *,
    count: int = 1,
    union: bool = False,
    seed: int = 0,
    controlnet: dict | None = None,
    vae: dict | None = None,
    transformer: dict | None = None,
) -> Path:
    """Write a tiny ``FluxControlNetPipeline`` into ``directory``; returns it.

    ``count`` ControlNets (``union``: with ``UNION_MODES`` control modes): the first saved as
    ``controlnet``, the others as ``controlnet_1``, ... with ``FluxMultiControlNetModel`` in
    model_index.json (diffusers cannot save that class itself: it has no config). The VAE's
    posterior is made tight (:func:`_tight_posterior`). ``controlnet`` / ``vae`` /
    ``transformer``: config entries replacing :data:`CONTROLNET`'s / :data:`VAE`'s /
    :data:`TRANSFORMER`'s."""
    import json

    import torch
    from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxPipeline

    directory = Path(directory)
    build_flux_pipeline(directory, seed=seed, vae=vae, transformer=transformer)
    base = FluxPipeline.from_pretrained(directory)
    _tight_posterior(base.vae)
    config = {**CONTROLNET, **({"num_mode": UNION_MODES} if union else {}), **(controlnet or {})}
    nets = []
    for k in range(count):
        torch.manual_seed(seed + 10 + k)
        nets.append(_perturbed(FluxControlNetModel(**config), seed + 10 + k))
    FluxControlNetPipeline(**base.components, controlnet=nets[0]).save_pretrained(directory)
    for k, net in enumerate(nets[1:], start=1):
        net.save_pretrained(directory / f"controlnet_{k}")
    if count > 1:
        index_path = directory / "model_index.json"
        index = json.loads(index_path.read_text())
        index["controlnet"] = ["diffusers", "FluxMultiControlNetModel"]
        index_path.write_text(json.dumps(index, indent=2))
    return directory


def load_diffusers_controlnet_pipeline(directory: str | Path, *, multi: bool = False):
    """diffusers' ``FluxControlNetPipeline`` of a :func:`build_flux_controlnet_pipeline`
    folder; ``multi``: its ControlNets as a ``FluxMultiControlNetModel`` (as the several
    ControlNets of a folder must be, and one union ControlNet with several conditions)."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxMultiControlNetModel

    directory = Path(directory)
    folders = [directory / "controlnet"]
    k = 1
    while (directory / f"controlnet_{k}").is_dir():
        folders.append(directory / f"controlnet_{k}")
        k += 1
    nets = [FluxControlNetModel.from_pretrained(folder) for folder in folders]
    controlnet = FluxMultiControlNetModel(nets) if multi or len(nets) > 1 else nets[0]
    return FluxControlNetPipeline.from_pretrained(directory, controlnet=controlnet)
