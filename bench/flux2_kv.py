"""Benchmark: the Flux.2 [klein] KV render (reference K/V once per render) vs the non-KV render.

One Klein-shaped transformer (random weights), one prompt, the same text embedding, noise and
reference latents, two renders through the Pipeline API's jitted denoising loop
(:meth:`jaxcore.pipeline.Pipeline.sample`, flow-match Euler with Klein's dynamic shift):

- ``difforge``: ``Flux2KleinKVPipeline``'s render (the references as ``kv_reference_<i>``):
  the reference tokens' per-layer K/V are computed once, before the loop
  (``Flux2Family.loop_conditioning``); each step runs the noise and text tokens only, their
  queries seeing the cached reference keys;
- ``difforge_no_kv``: ``Flux2KleinPipeline``'s render (``reference_<i>``): the reference
  tokens ride along with the noise tokens through every block at every step.

They are different functions (the KV path's reference tokens attend to themselves only, at a
fixed timestep), so no output is compared here: tests/jaxcore/test_flux2_kv.py proves each
against diffusers. What is timed is the denoising loop alone (text encoding and VAE decoding
are the same work in both). ``vs_difforge`` on the non-KV row = non-KV median / KV median, the
KV render's speed-up (also ``speedup`` on the KV row); ``flop_ratio`` the analytic one, from
:func:`jaxcore.families.flux2.flops` (non-KV: every step over noise + reference + text tokens;
KV: every step over noise + text tokens with the reference keys added to attention, plus the
references once). The two renders are timed in turn round by round
(:func:`bench.common.interleaved_times`), so a drift of the machine's speed reaches both.

Cases (CPU): ``S`` is FLUX.2 [klein] 4B's layout (1:4 double:single blocks, head dim 128,
SwiGLU ratio 3, Qwen3 text of 3 stacked layers, 128-channel patchified latents) at D = 512 with
2 double + 8 single blocks, a 512 x 512 render (32 x 32 tokens), one 512 x 512 reference
(1024 tokens), 512 text tokens and the KV pipeline's 4 steps; ``quick`` halves the image sides.
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np

from bench.common import BenchContext, interleaved_times, time_calls, timed_record

log = logging.getLogger(__name__)

BENCH = "flux2_kv"


@dataclasses.dataclass(frozen=True)
class KVCase:
    name: str
    transformer: dict  # Flux2TransformerConfig fields
    tokens: tuple[int, int]  # noise tokens (rows, cols): the render / 16
    references: tuple[tuple[int, int], ...]  # each reference's tokens (rows, cols)
    text_tokens: int
    steps: int = 4  # Flux2KleinKVPipeline's default


KLEIN_S = dict(
    in_channels=128,
    num_layers=2,
    num_single_layers=8,
    attention_head_dim=128,
    num_attention_heads=4,
    joint_attention_dim=3 * 512,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    guidance_embeds=False,
)
TINY = dict(
    in_channels=24,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=96,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
CASES = {
    "smoke": (KVCase("tiny", TINY, (4, 6), ((5, 4),), 8, steps=2),),
    "quick": (KVCase("S-256px", KLEIN_S, (16, 16), ((16, 16),), 512),),
    "full": (KVCase("S", KLEIN_S, (32, 32), ((32, 32),), 512),),
}


def _pipeline(config, seed: int = 0):
    """A Pipeline of the flux2 family around a randomly initialised transformer (the loop
    needs nothing else: the conditioning is given as tensors)."""
    from jaxcore.families import flux2
    from jaxcore.pipeline import Pipeline

    module, params = flux2.flux2_transformer.init_flux2_transformer(config, jax.random.key(seed))
    return Pipeline(
        family=flux2.Flux2Family(),
        denoiser=module,
        denoiser_params=params,
        components={},
        configs={"transformer": config, "pipeline": flux2.Flux2PipelineOptions()},
        scheduler_config=dict(flux2.REFERENCE_SCHEDULER_CONFIG),
    )


def _inputs(config, case: KVCase, seed: int = 0) -> tuple[np.ndarray, np.ndarray, list]:
    """(noise latents [1, 4c, h, w], text [1, T, joint_attention_dim], reference latents)."""
    rng = np.random.default_rng(seed)
    channels = config.in_channels
    noise = rng.standard_normal((1, channels, *case.tokens), np.float32)
    text = rng.standard_normal((1, case.text_tokens, config.joint_attention_dim), np.float32)
    refs = [rng.standard_normal((1, channels, *size), np.float32) for size in case.references]
    return noise, text, refs


def _flops(config, case: KVCase) -> tuple[int, int]:
    """Analytic matmul FLOPs of the whole loop: (KV render, non-KV render)."""
    from jaxcore.families import flux2

    noise = case.tokens[0] * case.tokens[1]
    refs = sum(h * w for h, w in case.references)
    text, d = case.text_tokens, config.hidden_dim
    blocks = config.num_layers + config.num_single_layers
    plain = flux2.flops(config, 1, noise + refs, text)
    # the KV step: noise + text tokens, their queries also scoring / mixing the reference keys
    kv_step = flux2.flops(config, 1, noise, text) + 2 * blocks * 2 * (noise + text) * refs * d
    # once: the reference tokens through every block, attending to themselves
    once = flux2.flops(config, 1, refs, 0)
    return case.steps * kv_step + once, case.steps * plain


def run_case(ctx: BenchContext, case: KVCase) -> list[dict]:
    from jaxcore.families import flux2
    from jaxcore.models.flux2_transformer import Flux2TransformerConfig

    config = Flux2TransformerConfig(**case.transformer)
    pipe = _pipeline(config)
    noise, text, refs = _inputs(config, case)

    def render_for(prefix: str):
        cond = {flux2.TEXT: text, **{f"{prefix}{i}": r for i, r in enumerate(refs)}}

        def render():
            out = pipe.sample(noise, cond, num_inference_steps=case.steps, cfg_scale=1.0)
            return jax.block_until_ready(out)

        return render

    calls = {"kv": render_for(flux2.KV_REFERENCE), "no_kv": render_for(flux2.REFERENCE)}
    # each program's first call (it compiles), outside the timed rounds
    first = {name: time_calls(fn, reps=0)[1] for name, fn in calls.items()}
    times = interleaved_times(calls, reps=ctx.reps, warmup=ctx.warmup)
    kv_flops, plain_flops = _flops(config, case)
    noise_tokens = case.tokens[0] * case.tokens[1]
    common = {
        "items": noise_tokens * case.steps,
        "item_unit": "noise tokens x steps",
        "steps": case.steps,
        "reference_tokens": sum(h * w for h, w in case.references),
        "text_tokens": case.text_tokens,
        "flop_ratio": plain_flops / kv_flops,
    }
    kv_median, plain_median = (float(np.median(times[k])) for k in ("kv", "no_kv"))
    log.info(
        "flux2 KV %s: KV %.3f s, non-KV %.3f s per render: %.2fx",
        case.name,
        kv_median,
        plain_median,
        plain_median / kv_median,
    )
    return [
        timed_record(
            BENCH,
            case.name,
            "difforge",
            times["kv"],
            flops=kv_flops,
            first_call_s=first["kv"],
            speedup=plain_median / kv_median,
            **common,
        ),
        timed_record(
            BENCH,
            case.name,
            "difforge_no_kv",
            times["no_kv"],
            flops=plain_flops,
            first_call_s=first["no_kv"],
            **common,
        ),
    ]


def run(ctx: BenchContext) -> list[dict]:
    records = []
    for case in CASES[ctx.profile]:
        log.info("flux2 KV render: case %s", case.name)
        records += run_case(ctx, case)
    return records
