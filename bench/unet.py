"""Benchmark: one Stable Diffusion UNet forward (one denoising step), difforge vs diffusers.

Same weights: diffusers' ``UNet2DConditionModel`` is built from the config with a fixed seed,
written with ``save_pretrained`` and read by ``load_unet_2d_condition``; both outputs are
compared (``max_abs_diff``) so the timings are of the same computation. diffusers runs eager
and under ``torch.compile`` with as many threads as XLA uses. FLOPs:
``jaxcore.families.sd.unet_flops``.

Cases, each a shipped layout at half its width (the full-width UNets hold 0.9-2.6 B parameters:
SDXL's, 10 GB a copy in float32, would not fit twice beside the compiles in a 24 GB machine), on
64 x 64 latents (512² images) and 77 text tokens:

- ``tiny``: SD 2's layout at a few channels (smoke);
- ``SD2-half``: configs/models/sd2_base.yml, block widths 160-640 (4 levels, attention at the
  first three, linear projections);
- ``SDXL-half``: configs/models/sdxl_base.yml, block widths 160-640 (3 levels, 1/2/10 transformer
  blocks, the text-time embedding with pooled text and six time ids).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import numpy as np

from bench.common import BenchContext, diffusers_model
from bench.transformer import compare_with_diffusers
from jaxcore.model_configs import load_model_yaml
from jaxcore.models import unet_2d_condition as unet

log = logging.getLogger(__name__)

BENCH = "unet_forward"
REPO = Path(__file__).resolve().parent.parent
TEXT_TOKENS = 77


@dataclasses.dataclass(frozen=True)
class UNetCase:
    name: str
    model_yaml: str
    latent_size: int
    overrides: tuple[tuple[str, object], ...]  # UNet2DConditionConfig fields replaced
    torch_compile: bool = True

    def config(self) -> unet.UNet2DConditionConfig:
        base = load_model_yaml(REPO / self.model_yaml, ("unet",))["unet"]
        return dataclasses.replace(base, **dict(self.overrides))


TINY = UNetCase(
    "tiny",
    "configs/models/sd2_base.yml",
    16,
    (
        ("block_out_channels", (32, 32, 64, 64)),
        ("attention_head_dim", (2, 2, 4, 4)),
        ("cross_attention_dim", 32),
        ("norm_num_groups", 8),
    ),
    torch_compile=False,
)
SD2_HALF = UNetCase(
    "SD2-half", "configs/models/sd2_base.yml", 64, (("block_out_channels", (160, 320, 640, 640)),)
)
SDXL_HALF = UNetCase(
    "SDXL-half", "configs/models/sdxl_base.yml", 64, (("block_out_channels", (160, 320, 640)),)
)
CASES = {"smoke": (TINY,), "quick": (TINY, SD2_HALF), "full": (SD2_HALF, SDXL_HALF)}


def make_inputs(config: unet.UNet2DConditionConfig, case: UNetCase, seed: int = 0) -> dict:
    """Our forward's arguments (``text_embeds`` / ``time_ids`` None without the text-time
    embedding)."""
    rng = np.random.default_rng(seed)
    size = case.latent_size
    inputs = {
        "sample": rng.standard_normal((1, config.in_channels, size, size), np.float32),
        "timestep": np.full((1,), 500.0, np.float32),
        "encoder_hidden_states": rng.standard_normal(
            (1, TEXT_TOKENS, config.cross_attention_dim), np.float32
        ),
        "text_embeds": None,
        "time_ids": None,
    }
    if config.addition_embed_type == unet.TEXT_TIME:
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        inputs["text_embeds"] = rng.standard_normal((1, pooled), np.float32)
        # original size, crop corner, target size (SDXL's micro-conditioning)
        inputs["time_ids"] = np.array([[8 * size, 8 * size, 0, 0, 8 * size, 8 * size]], np.float32)
    return inputs


def torch_inputs(inputs: dict) -> dict:
    import torch

    out = {
        name: torch.from_numpy(inputs[name])
        for name in ("sample", "timestep", "encoder_hidden_states")
    }
    if inputs["text_embeds"] is not None:
        out["added_cond_kwargs"] = {
            "text_embeds": torch.from_numpy(inputs["text_embeds"]),
            "time_ids": torch.from_numpy(inputs["time_ids"]),
        }
    return out | {"return_dict": False}


def run_case(ctx: BenchContext, case: UNetCase) -> list[dict]:
    from jaxcore.families.sd import unet_flops

    config = case.config()
    directory = ctx.scratch(f"unet_{case.name}")
    torch_model = diffusers_model("UNet2DConditionModel", config, directory)
    inputs = make_inputs(config, case)
    size = case.latent_size
    common = {
        "flops": unet_flops(config, size, size, TEXT_TOKENS),
        "items": size * size,
        "item_unit": "latent pixels",
    }
    names = ("sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids")
    arrays = [inputs[name] for name in names]

    def forward_for(attention: str):
        module, params = unet.load_unet_2d_condition(directory, attention=attention)

        @jax.jit
        def forward(params, *args):
            return module.apply({"params": params}, *args)

        return lambda: forward(params, *arrays)

    return compare_with_diffusers(
        ctx,
        BENCH,
        case.name,
        forward_for,
        torch_model,
        torch_inputs(inputs),
        common,
        torch_compile=case.torch_compile,
        params=unet.count_params(config),
    )


def run(ctx: BenchContext) -> list[dict]:
    records = []
    for case in CASES[ctx.profile]:
        log.info("unet forward: case %s", case.name)
        records += run_case(ctx, case)
    return records
