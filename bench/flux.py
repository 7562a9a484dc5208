"""Benchmark: one Flux.1 transformer forward (one denoising step), difforge vs diffusers.

Same weights: diffusers' ``FluxTransformer2DModel`` is built from the config with a fixed seed,
written with ``save_pretrained`` and read by ``load_flux_transformer``; both outputs are
compared (``max_abs_diff``) so the timings are of the same computation. diffusers runs eager
and under ``torch.compile`` with as many threads as XLA uses. FLOPs:
``flux_transformer.flops_per_forward``.

Cases: ``tiny`` (configs/models/flux_tiny.yml) and ``S`` (configs/models/flux_bench_s.yml:
FLUX.1-dev's layout at D = 512 with 2 double + 4 single blocks; 1024 image tokens = 64 x 64
latents packed 2 x 2, and 512 T5 tokens, as the Wan bench's S).
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
from jaxcore.models import flux_transformer as flux

log = logging.getLogger(__name__)

BENCH = "flux_forward"
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class FluxCase:
    name: str
    model_yaml: str
    batch: int
    latent_height: int  # unpacked latent rows (image tokens = rows/2 * cols/2)
    latent_width: int
    text_tokens: int
    torch_compile: bool = True

    def config(self) -> flux.FluxTransformerConfig:
        return load_model_yaml(REPO / self.model_yaml, ("transformer",))["transformer"]


TINY = FluxCase("tiny", "configs/models/flux_tiny.yml", 1, 8, 8, 16)
BENCH_S = FluxCase("S", "configs/models/flux_bench_s.yml", 1, 64, 64, 512)
CASES = {"smoke": (TINY,), "quick": (TINY, BENCH_S), "full": (TINY, BENCH_S)}


def make_inputs(config: flux.FluxTransformerConfig, case: FluxCase, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = (case.latent_height // 2) * (case.latent_width // 2)
    return {
        "hidden_states": rng.standard_normal((case.batch, tokens, config.in_channels), np.float32),
        "encoder_hidden_states": rng.standard_normal(
            (case.batch, case.text_tokens, config.joint_attention_dim), np.float32
        ),
        "pooled_projections": rng.standard_normal(
            (case.batch, config.pooled_projection_dim), np.float32
        ),
        "timestep": np.full((case.batch,), 0.5, np.float32),
        "img_ids": flux.latent_image_ids(case.latent_height, case.latent_width),
        "txt_ids": np.zeros((case.text_tokens, 3), np.float32),
        "guidance": np.full((case.batch,), 3.5, np.float32) if config.guidance_embeds else None,
    }


def run_case(ctx: BenchContext, case: FluxCase) -> list[dict]:
    import torch

    config = case.config()
    directory = ctx.scratch(f"flux_{case.name}")
    torch_model = diffusers_model("FluxTransformer2DModel", config, directory)
    inputs = make_inputs(config, case)
    image_tokens = inputs["hidden_states"].shape[1]
    flops = flux.flops_per_forward(config, case.batch, image_tokens, case.text_tokens)
    common = {"flops": flops, "items": case.batch * image_tokens, "item_unit": "image tokens"}
    # ids are static (closed over): the RoPE tables are then computed exactly on the host
    img_ids, txt_ids = inputs["img_ids"], inputs["txt_ids"]
    arrays = [inputs[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections")]

    def forward_for(attention: str):
        module, params = flux.load_flux_transformer(directory, attention=attention)

        @jax.jit
        def forward(params, x, text, pooled, t, guidance):
            return module.apply({"params": params}, x, text, pooled, t, img_ids, txt_ids, guidance)

        return lambda: forward(params, *arrays, inputs["timestep"], inputs["guidance"])

    t_inputs = {k: (torch.from_numpy(v) if v is not None else None) for k, v in inputs.items()} | {
        "return_dict": False
    }
    return compare_with_diffusers(
        ctx,
        BENCH,
        case.name,
        forward_for,
        torch_model,
        t_inputs,
        common,
        torch_compile=case.torch_compile,
        params=flux.count_params(config),
    )


def run(ctx: BenchContext) -> list[dict]:
    records = []
    for case in CASES[ctx.profile]:
        log.info("flux forward: case %s", case.name)
        records += run_case(ctx, case)
    return records
