"""Step caching on LTX-Video: First-Block-Cache and MagCache (diffusers registers
``LTXVideoTransformerBlock`` for both hooks) decide as diffusers' hooks do, one prompt per
diffusers call without CFG: the same number of block-stack runs per prompt (First-Block at
0.15: 3 of 8 steps; MagCache: 3 of 7) and frames within 1e-4 on [0, 1] pixels (measured 8.3e-7
and 9.5e-7). With CFG, diffusers' LTXPipeline runs both branches as
one batch and its hook decides for the whole batch, where difforge decides per row (as for
Wan); that case is checked to run and skip, not against diffusers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxcore import step_cache
from jaxcore.families import load_pipeline
from jaxcore.models import ltx_transformer
from jaxcore.sampling import initial_latents
from tests.support.tiny_ltx import build_ltx_pipeline

TOLERANCE = 1e-4
PROMPTS = ["a red circle on a white background", "blue square"]
SEEDS = (3, 4)
SIZE = (32, 32, 9)
LENGTH = 128
CASES = {
    "first_block": (step_cache.CacheConfig("first_block", threshold=0.15), 8),
    "magcache": (
        step_cache.CacheConfig(
            "magcache",
            threshold=0.1,
            max_skip_steps=2,
            mag_ratios=(1.0, 1.0, 0.99, 0.98, 0.97, 0.96, 0.95),
        ),
        7,
    ),
}


@pytest.fixture(scope="module")
def ltx(tmp_path_factory):
    from diffusers import LTXPipeline

    directory = build_ltx_pipeline(tmp_path_factory.mktemp("ltx_cache"), seed=3)
    reference = LTXPipeline.from_pretrained(directory)
    calls: list = []
    tail = reference.transformer.transformer_blocks[-1].ff  # runs only when the stack does
    tail.register_forward_hook(lambda *args: calls.append(1))
    return load_pipeline(directory), reference, calls


def _ours(pipe, config, steps, guidance):
    shape = pipe.latent_shape(*SIZE)
    latents = np.stack([initial_latents(s, shape) for s in SEEDS])
    cond, uncond, scales = pipe.conditioning(
        PROMPTS, ["", ""], [pipe.guidance(guidance)] * 2, LENGTH, size=SIZE
    )
    plan, schedule = step_cache.NO_CACHE, None
    if config is not None:
        plan = step_cache.plan_of(config)
        schedule = step_cache.schedule_for(config, config.mag_ratios, steps)
    z, stats = pipe.sample_with_stats(
        latents,
        cond,
        uncond,
        num_inference_steps=steps,
        cfg_scale=scales,
        cache=plan,
        cache_schedule=schedule,
    )
    return np.asarray(pipe.decode(z, cond)), stats, latents


def _torch_config(config, steps):
    from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig

    if config.kind == "first_block":
        return FirstBlockCacheConfig(threshold=config.effective_threshold)
    return MagCacheConfig(
        threshold=config.effective_threshold,
        max_skip_steps=config.max_skip_steps,
        retention_ratio=config.retention_ratio,
        num_inference_steps=steps,
        mag_ratios=list(config.mag_ratios),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_ltx_caches_match_diffusers_hooks(ltx, case):
    config, steps = CASES[case]
    pipe, reference, calls = ltx
    ours, stats, latents = _ours(pipe, config, steps, 1.0)
    packed = np.asarray(ltx_transformer.pack_latents(latents))
    theirs, runs = [], []
    height, width, frames = SIZE
    for k in range(len(PROMPTS)):
        calls.clear()
        reference.transformer.enable_cache(_torch_config(config, steps))
        try:
            out = reference(
                prompt=PROMPTS[k],
                height=height,
                width=width,
                num_frames=frames,
                num_inference_steps=steps,
                guidance_scale=1.0,
                latents=torch.from_numpy(packed[k : k + 1]),
                max_sequence_length=LENGTH,
                output_type="np",
            ).frames
        finally:
            reference.transformer.disable_cache()
        theirs.append(out[0])
        runs.append(len(calls))
    assert list(np.asarray(stats["block_stack_runs"])) == runs
    assert 0 < sum(runs) < 2 * steps  # something was skipped
    np.testing.assert_allclose(ours, np.stack(theirs), atol=TOLERANCE, rtol=0)


def test_ltx_cache_with_cfg_runs_and_skips(ltx):
    pipe = ltx[0]
    config = step_cache.CacheConfig("first_block", threshold=0.9)
    cached, stats, _ = _ours(pipe, config, 8, 3.0)
    dense, _, _ = _ours(pipe, None, 8, 3.0)
    assert int(np.sum(stats["block_stack_skips"])) > 0
    assert 0 < np.abs(cached - dense).max() < 0.5
