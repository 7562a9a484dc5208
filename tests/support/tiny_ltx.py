"""Tiny random-init diffusers ``LTXPipeline`` / ``LTXImageToVideoPipeline`` directories, built
with diffusers/transformers (PyTorch) and written with ``save_pretrained``: the reference the
LTX-Video family is tested against.

Every parameter is perturbed (``p += 0.1 * randn``, the VAE's by 0.05) so a mis-mapped weight, a skipped norm or a
wrong bias changes the output. The pieces are off their defaults where the pipeline reads
them: the scheduler shifts dynamically with other ``base_shift`` / ``max_shift`` /
``*_image_seq_len`` values and stretches to a ``shift_terminal``; the VAE (0.9.5-style levels,
8 x 8 pixels and 4 frames per latent voxel, both stated as diffusers' pipelines read them) is
timestep-conditioned, with other ``latents_mean`` / ``latents_std`` and ``scaling_factor``.

Two settings keep diffusers' own random draws out of the comparison: the decoder injects no
noise (``decoder_inject_noise`` off: diffusers draws it with the global ``torch.randn``), and
the encoder's log-variance channel is biased to -1000 (clamped to -30), so the posterior
*sample* diffusers' image-to-video pipeline takes of a conditioning image is its mean within
``exp(-15) ~ 3e-7`` times a normal draw.

The T5 tokenizer is the offline tiny one of ``pipelines.embedded.tokenizers`` with LTX's
``model_max_length`` of 128.
"""

from __future__ import annotations

import shutil
from pathlib import Path

# width D = 2 x 8 = 16 (16 % 6 = 4: two unrotated channel pairs); captions from the T5's 32
TRANSFORMER = dict(
    in_channels=8,
    out_channels=8,
    num_layers=2,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    caption_channels=32,
)
VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=8,
    block_out_channels=(8, 16, 16, 32),
    down_block_types=("LTXVideo095DownBlock3D",) * 3,
    decoder_block_out_channels=(16, 16, 32),
    layers_per_block=(1, 1, 1, 1),
    decoder_layers_per_block=(1, 1, 1, 1),
    spatio_temporal_scaling=(True, True, True),
    decoder_spatio_temporal_scaling=(True, False, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal"),
    upsample_residual=(False, False, True),
    upsample_factor=(2, 1, 2),
    timestep_conditioning=True,
    patch_size=2,
    scaling_factor=0.7,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
)
T5 = dict(  # d_model = the transformer's caption_channels
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
# LTX-Video 0.9.1's scheduler has base_shift 0.95, max_shift 2.05, base/max_image_seq_len
# 1024 / 4096 and shift_terminal 0.1; the tiny renders have ~100 tokens, so the line is moved
# to where they fall and every value differs from diffusers' defaults.
SCHEDULER = dict(
    use_dynamic_shifting=True,
    base_shift=0.8,
    max_shift=1.7,
    base_image_seq_len=32,
    max_image_seq_len=512,
    shift_terminal=0.15,
)
# LTXConditionPipeline passes its own timesteps and no mu: 0.9.5 / 0.9.7 ship the scheduler's
# defaults (no dynamic shifting), as the tiny condition pipeline does
CONDITION_SCHEDULER = dict(shift=1.0)
TOKENIZER_MAX_LENGTH = 128  # diffusers' convert_ltx_to_diffusers.py
LOGVAR_BIAS = -1000.0


def _perturbed(model, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model.eval()


def _vae(seed: int, options: dict | None = None):
    """The VAE (``options`` over :data:`VAE`) with every parameter perturbed, the timestep
    scale kept ~1000, non-default latent statistics and a near-zero posterior variance (see
    the module docstring)."""
    import torch
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(seed)
    vae = AutoencoderKLLTXVideo(**{**VAE, **(options or {})})
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("timestep_scale_multiplier"):
                p.mul_(1.0 + 0.1 * torch.randn((), generator=generator))
            else:
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        vae.encoder.conv_out.conv.bias[-1] = LOGVAR_BIAS
        channels = VAE["latent_channels"]
        vae.latents_mean.copy_(0.3 * torch.randn(channels, generator=generator))
        vae.latents_std.copy_(0.6 + torch.rand(channels, generator=generator))
    return vae.eval()


def build_ltx_pipeline(
    directory: str | Path,
    *,
    seed: int = 0,
    image_to_video: bool = False,
    condition: bool = False,
    scheduler: dict | None = None,
    vae: dict | None = None,
) -> Path:
    """Write a tiny ``LTXPipeline`` (``image_to_video``: ``LTXImageToVideoPipeline``;
    ``condition``: ``LTXConditionPipeline`` with :data:`CONDITION_SCHEDULER`; the same
    components) into ``directory``; returns it. ``vae``: config values over :data:`VAE` (e.g.
    a decoder that injects noise, as 0.9.1's)."""
    import torch
    import transformers
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        LTXImageToVideoPipeline,
        LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    from pipelines.embedded.tokenizers import build_tiny_tokenizer

    directory = Path(directory)
    tokenizer = build_tiny_tokenizer(
        directory / "_tokenizer", vocab_size=T5["vocab_size"], model_max_length=TOKENIZER_MAX_LENGTH
    )
    torch.manual_seed(seed)
    cls = LTXImageToVideoPipeline if image_to_video else LTXPipeline
    if condition:
        from diffusers import LTXConditionPipeline

        cls = LTXConditionPipeline
        scheduler = CONDITION_SCHEDULER if scheduler is None else scheduler
    pipe = cls(
        transformer=_perturbed(LTXVideoTransformer3DModel(**TRANSFORMER), seed),
        vae=_vae(seed + 1, vae),
        text_encoder=_perturbed(transformers.T5EncoderModel(transformers.T5Config(**T5)), seed + 2),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(**(scheduler or SCHEDULER)),
    )
    pipe.save_pretrained(directory)
    shutil.rmtree(directory / "_tokenizer")
    return directory
