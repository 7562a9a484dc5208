"""Tiny Wan 2.2 / image-to-video pipelines for parity tests, built from the tiny Wan 2.1 one.

Each builder starts from :func:`pipelines.embedded.tiny.build_tiny_wan_pipeline` (our own writer,
which diffusers loads) and replaces or adds components the way diffusers' ``save_pretrained``
lays them out; components our writer cannot make yet are made with diffusers / transformers
PyTorch (random init) and ``save_pretrained``. Random-init transformers predict tiny
velocities, so output projections are scaled up to make guidance and the expert switch
visible in the renders.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.embedded.tiny import build_tiny_wan_pipeline

OUTPUT_SCALE = 20.0
# The tiny Wan VAE of configs/models/wan_tiny.yml: z_dim 4, 2x compression in space and time.
Z = 4
TEMPORAL = 2  # I2V mask channels: one per pixel frame a latent frame folds (4 for real VAEs)


def _edit_index(root: Path, **entries) -> None:
    path = root / "model_index.json"
    index = json.loads(path.read_text())
    index.update(entries)
    path.write_text(json.dumps(index, indent=2))


def _scaled_torch_transformer(seed: int, **config):
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config)
    with torch.no_grad():
        model.proj_out.weight.mul_(OUTPUT_SCALE)
        model.proj_out.bias.mul_(OUTPUT_SCALE)
    return model


TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=16,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=64,
)


def build_two_expert_pipeline(directory, *, boundary_ratio: float = 0.875, seed: int = 0) -> Path:
    """A Wan 2.2 A14B-shaped ``WanPipeline``: ``transformer`` (high noise) + ``transformer_2``
    (low noise, other weights) and ``boundary_ratio``."""
    root = build_tiny_wan_pipeline(directory, seed=seed, transformer_output_scale=OUTPUT_SCALE)
    second = _scaled_torch_transformer(
        seed + 100, in_channels=Z, out_channels=Z, **TINY_TRANSFORMER
    )
    second.save_pretrained(root / "transformer_2")
    _edit_index(
        root,
        transformer_2=["diffusers", "WanTransformer3DModel"],
        boundary_ratio=boundary_ratio,
    )
    return root


def _tiny_clip_vision(root: Path, seed: int) -> None:
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=28,
        patch_size=7,
        projection_dim=16,
        hidden_act="gelu",
    )
    CLIPVisionModel(config).save_pretrained(root / "image_encoder")
    CLIPImageProcessor(
        size={"shortest_edge": 28},
        crop_size={"height": 28, "width": 28},
        do_center_crop=True,
        resample=3,
    ).save_pretrained(root / "image_processor")


def build_i2v_pipeline(
    directory,
    *,
    image_encoder: bool = True,
    flf2v: bool = False,
    second_expert: bool = False,
    seed: int = 0,
) -> Path:
    """A ``WanImageToVideoPipeline``: Wan 2.1 I2V (``image_encoder=True``: a CLIP vision
    encoder and image cross-attention; ``flf2v``: first-last-frame position embeddings) or
    Wan 2.2 I2V A14B (``image_encoder=False, second_expert=True``)."""
    root = build_tiny_wan_pipeline(directory, seed=seed)
    config = dict(TINY_TRANSFORMER, in_channels=2 * Z + TEMPORAL, out_channels=Z)
    if image_encoder:
        config.update(image_dim=24, added_kv_proj_dim=32)
        if flf2v:
            config.update(pos_embed_seq_len=2 * 17)  # two images of 16 patches + class token
        _tiny_clip_vision(root, seed + 7)
    _scaled_torch_transformer(seed + 1, **config).save_pretrained(root / "transformer")
    entries = {"_class_name": "WanImageToVideoPipeline"}
    if image_encoder:
        entries.update(
            image_encoder=["transformers", "CLIPVisionModel"],
            image_processor=["transformers", "CLIPImageProcessor"],
        )
    else:
        entries.update(image_encoder=[None, None], image_processor=[None, None])
    if second_expert:
        _scaled_torch_transformer(seed + 2, **config).save_pretrained(root / "transformer_2")
        entries.update(transformer_2=["diffusers", "WanTransformer3DModel"], boundary_ratio=0.9)
    _edit_index(root, **entries)
    return root


TI2V_VAE = dict(
    base_dim=8,
    decoder_base_dim=12,
    z_dim=8,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True],
    dropout=0.0,
    is_residual=True,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    scale_factor_spatial=8,
    scale_factor_temporal=2,
    latents_mean=[0.0] * 8,
    latents_std=[1.0] * 8,
)


def build_ti2v_pipeline(directory, *, seed: int = 0) -> Path:
    """A Wan 2.2 TI2V-5B-shaped ``WanPipeline``: the residual, patchified VAE (z 8 here, 48 in
    the real model) and ``expand_timesteps``."""
    import torch
    from diffusers import AutoencoderKLWan

    root = build_tiny_wan_pipeline(directory, seed=seed)
    torch.manual_seed(seed + 3)
    AutoencoderKLWan(**TI2V_VAE).save_pretrained(root / "vae")
    z = TI2V_VAE["z_dim"]
    _scaled_torch_transformer(
        seed + 4, **dict(TINY_TRANSFORMER, in_channels=z, out_channels=z)
    ).save_pretrained(root / "transformer")
    _edit_index(root, expand_timesteps=True)
    return root


def write_one_layer_wan_yaml(directory: Path) -> str:
    """configs/models/wan_tiny.yml with one transformer block (compiles faster), written into
    ``directory``; returns its path."""
    import yaml

    repo = Path(__file__).resolve().parents[2]
    sections = yaml.safe_load((repo / "configs/models/wan_tiny.yml").read_text())
    sections["transformer"]["num_layers"] = 1
    path = Path(directory) / "wan_one_layer.yml"
    path.write_text(yaml.safe_dump(sections))
    return str(path)
