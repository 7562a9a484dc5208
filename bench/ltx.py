"""Benchmark: one LTX-Video transformer forward (one denoising step), difforge vs diffusers.

Same weights: diffusers' ``LTXVideoTransformer3DModel`` is built from the config with a fixed
seed, written with ``save_pretrained`` and read by ``load_ltx_transformer``; both outputs are
compared (``max_abs_diff``) so the timings are of the same computation. diffusers runs eager
and under ``torch.compile`` with as many threads as XLA uses. FLOPs:
``ltx_transformer.flops_per_forward``.

Inputs as the pipelines give them: packed latent tokens [B, F' H' W', C], T5-sized caption
states [B, S, 4096] with an attention mask (the last quarter of the tokens padding), one
timestep per sample and the RoPE scale of a frame rate (``frame_rate_rope_scale(25)``: LTXPipeline
passes it with the token grid; difforge takes it per row as the ltx family does, the coordinates
``grid positions x scale`` computed in the graph, :func:`jaxcore.families.ltx.video_coords`).

Cases: ``tiny`` (configs/models/ltx_tiny.yml) and ``S`` (configs/models/ltx_bench_s.yml:
LTX-Video's layout at D = 8 x 64 = 512 with 8 blocks; a 5 x 16 x 16 latent grid = 1280 tokens
of 128 channels and 128 T5 tokens, about the work of the Wan bench's S).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import numpy as np

from bench.common import BenchContext, diffusers_model
from bench.transformer import compare_with_diffusers
from jaxcore.families.ltx import video_coords
from jaxcore.model_configs import load_model_yaml
from jaxcore.models import ltx_transformer as ltx

log = logging.getLogger(__name__)

BENCH = "ltx_forward"
REPO = Path(__file__).resolve().parent.parent
FRAME_RATE = 25.0  # the pipelines' default frame_rate


@dataclasses.dataclass(frozen=True)
class LTXCase:
    name: str
    model_yaml: str
    batch: int
    grid: tuple[int, int, int]  # latent (frames, height, width) = the token grid (patch 1)
    text_tokens: int
    torch_compile: bool = True

    def config(self) -> ltx.LTXVideoTransformerConfig:
        return load_model_yaml(REPO / self.model_yaml, ("transformer",))["transformer"]

    @property
    def tokens(self) -> int:
        return int(np.prod(self.grid))


TINY = LTXCase("tiny", "configs/models/ltx_tiny.yml", 1, (2, 4, 4), 16)
BENCH_S = LTXCase("S", "configs/models/ltx_bench_s.yml", 1, (5, 16, 16), 128)
CASES = {"smoke": (TINY,), "quick": (TINY, BENCH_S), "full": (TINY, BENCH_S)}


def make_inputs(config: ltx.LTXVideoTransformerConfig, case: LTXCase, seed: int = 0) -> dict:
    """Packed tokens, captions with a mask (the last quarter padding), timestep, RoPE scale."""
    rng = np.random.default_rng(seed)
    mask = np.ones((case.batch, case.text_tokens), np.float32)
    mask[:, case.text_tokens - case.text_tokens // 4 :] = 0.0
    return {
        "hidden_states": rng.standard_normal(
            (case.batch, case.tokens, config.in_channels), np.float32
        ),
        "encoder_hidden_states": rng.standard_normal(
            (case.batch, case.text_tokens, config.caption_channels), np.float32
        ),
        "timestep": np.full((case.batch,), 500.0, np.float32),
        "encoder_attention_mask": mask,
    }


def run_case(ctx: BenchContext, case: LTXCase) -> list[dict]:
    import torch

    config = case.config()
    directory = ctx.scratch(f"ltx_{case.name}")
    torch_model = diffusers_model("LTXVideoTransformer3DModel", config, directory)
    inputs = make_inputs(config, case)
    flops = ltx.flops_per_forward(config, case.batch, case.tokens, case.text_tokens)
    common = {"flops": flops, "items": case.batch * case.tokens, "item_unit": "video tokens"}
    scale = ltx.frame_rate_rope_scale(FRAME_RATE)
    scale_b3 = np.tile(np.asarray(scale, np.float32)[None], (case.batch, 1))
    grid = case.grid
    arrays = [inputs[k] for k in ("hidden_states", "encoder_hidden_states", "timestep")]

    def forward_for(attention: str):
        module, params = ltx.load_ltx_transformer(directory, attention=attention)

        @jax.jit
        def forward(params, x, text, t, mask, scale_b3):
            # as the ltx family applies it: per-row RoPE scale -> coordinates in the graph
            coords = video_coords(scale_b3, grid)
            return module.apply({"params": params}, x, text, t, mask, video_coords=coords)

        return lambda: forward(params, *arrays, inputs["encoder_attention_mask"], scale_b3)

    f, h, w = grid
    t_inputs = {k: torch.from_numpy(v) for k, v in inputs.items()} | {
        "num_frames": f,
        "height": h,
        "width": w,
        "rope_interpolation_scale": scale,
        "return_dict": False,
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
        params=ltx.count_params(config),
        frame_rate=FRAME_RATE,
    )


def run(ctx: BenchContext) -> list[dict]:
    records = []
    for case in CASES[ctx.profile]:
        log.info("ltx forward: case %s", case.name)
        records += run_case(ctx, case)
    return records
