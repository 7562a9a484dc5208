"""Step caching (jaxcore/step_cache.py) and batched CFG vs diffusers' cache hooks.

Tiny random-init Wan and Flux pipelines render with First-Block-Cache and MagCache in diffusers
(``transformer.enable_cache(FirstBlockCacheConfig / MagCacheConfig)``) and here with the same
settings; the skip decisions must be the same (block-stack evaluations counted in diffusers by
a hook on the last block's feed-forward, which runs only when the stack is computed) and the
pixels equal within 1e-4. diffusers renders one prompt per call (its decision is per cache
context = per branch of that call); here both prompts render in one batch, whose rows decide
alone, so this also proves a prompt's render does not depend on its batch.

The tiny random models change fast between steps (their first-block residual moves by 60-100%
per step), so the First-Block thresholds here are large; real models use 0.05-0.2.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from jaxcore import step_cache
from jaxcore.families import flux as flux_family
from jaxcore.families import load_pipeline
from jaxcore.models import flux_transformer
from jaxcore.sampling import initial_latents
from pipelines.embedded.tiny import build_tiny_wan_pipeline
from tests.support.tiny_flux import build_flux_pipeline

TOLERANCE = 1e-4
PROMPTS = ["a red circle", "blue square moving left"]
NEGATIVE = ["dark background", ""]
SEEDS = (3, 4)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    from diffusers import WanPipeline

    directory = build_tiny_wan_pipeline(
        tmp_path_factory.mktemp("tiny_wan"), seed=1, transformer_output_scale=20.0
    )
    reference = WanPipeline.from_pretrained(directory)
    return (
        load_pipeline(directory),
        reference,
        _count_stack_runs(reference.transformer.blocks[-1].ffn),
    )


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    from diffusers import FluxPipeline

    directory = build_flux_pipeline(tmp_path_factory.mktemp("flux"), seed=1)
    reference = FluxPipeline.from_pretrained(directory)
    tail = reference.transformer.single_transformer_blocks[-1].proj_out
    return load_pipeline(directory), reference, _count_stack_runs(tail)


def _count_stack_runs(module) -> list:
    calls: list = []
    module.register_forward_hook(lambda *args: calls.append(1))
    return calls


def _plan(config: step_cache.CacheConfig, steps: int):
    ratios = config.mag_ratios
    return step_cache.plan_of(config), step_cache.schedule_for(config, ratios, steps)


def _torch_config(config: step_cache.CacheConfig, steps: int):
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


def _wan_ours(pipe, config, steps, guidance, batched=True):
    shape = pipe.latent_shape(16, 16, 1)
    latents = np.stack([initial_latents(s, shape) for s in SEEDS])
    cond, uncond, scales = pipe.conditioning(PROMPTS, NEGATIVE, [pipe.guidance(guidance)] * 2, 512)
    plan, schedule = _plan(config, steps) if config else (step_cache.NO_CACHE, None)
    z, stats = pipe.sample_with_stats(
        latents,
        cond,
        uncond,
        num_inference_steps=steps,
        cfg_scale=scales,
        cache=plan,
        cache_schedule=schedule,
        batched_cfg=batched,
    )
    return np.asarray(pipe.decode(z))[:, 0], stats, latents


def _wan_theirs(reference, calls, config, steps, guidance, latents):
    """diffusers, one prompt per call; returns (frames [B, H, W, 3], stack runs per prompt)."""
    import torch

    frames, runs = [], []
    for k in range(len(PROMPTS)):
        calls.clear()
        reference.transformer.enable_cache(_torch_config(config, steps))
        try:
            out = reference(
                prompt=PROMPTS[k],
                negative_prompt=NEGATIVE[k],
                height=16,
                width=16,
                num_frames=1,
                num_inference_steps=steps,
                guidance_scale=guidance,
                latents=torch.from_numpy(latents[k : k + 1]),
                output_type="np",
            ).frames
        finally:
            reference.transformer.disable_cache()
        frames.append(out[0, 0])
        runs.append(len(calls))
    return np.stack(frames), runs


WAN_CASES = {
    "first_block_mixed": (step_cache.CacheConfig("first_block", threshold=0.85), 8, 4.0),
    "first_block_no_cfg": (step_cache.CacheConfig("first_block", threshold=1.0), 6, 1.0),
    "magcache_default": (
        step_cache.CacheConfig("magcache", mag_ratios=(1.0, 1.02, 0.99, 1.01, 1.0, 0.96, 0.9)),
        10,
        4.0,
    ),
    "magcache_odd": (
        step_cache.CacheConfig(
            "magcache",
            threshold=0.03,
            max_skip_steps=1,
            retention_ratio=0.0,
            mag_ratios=(1.0, 1.01, 1.0, 0.99, 1.02),
        ),
        7,
        1.0,
    ),
}


@pytest.mark.parametrize("case", list(WAN_CASES))
def test_wan_caches_match_diffusers_hooks(wan, case):
    config, steps, guidance = WAN_CASES[case]
    pipe, reference, calls = wan
    ours, stats, latents = _wan_ours(pipe, config, steps, guidance)
    theirs, runs = _wan_theirs(reference, calls, config, steps, guidance, latents)
    branches = 2 if guidance > 1 else 1
    assert list(np.asarray(stats["block_stack_runs"])) == runs
    total = np.asarray(stats["block_stack_runs"]) + np.asarray(stats["block_stack_skips"])
    assert list(total) == [branches * steps] * 2
    assert 0 < sum(runs) < 2 * branches * steps  # some steps skipped, some computed
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0)
    dense, _, _ = _wan_ours(pipe, None, steps, guidance)
    assert np.abs(dense - ours).max() > 1e-4  # the cache changed the render: skips were real


def test_first_block_rows_decide_alone(wan):
    """A threshold where the two prompts decide differently: each row matches its own
    diffusers render, and a row that skips inside a computing batch takes its cache."""
    config = step_cache.CacheConfig("first_block", threshold=0.95)
    pipe, reference, calls = wan
    _, stats, latents = _wan_ours(pipe, config, 8, 4.0)
    _, runs = _wan_theirs(reference, calls, config, 8, 4.0, latents)
    assert list(np.asarray(stats["block_stack_runs"])) == runs
    assert runs[0] != runs[1], "pick a threshold where the prompts differ"


def test_batched_cfg_equals_two_calls(wan):
    pipe = wan[0]
    one, _, _ = _wan_ours(pipe, None, 4, 5.0, batched=True)
    two, _, _ = _wan_ours(pipe, None, 4, 5.0, batched=False)
    np.testing.assert_allclose(one, two, atol=1e-5, rtol=0)
    config = step_cache.CacheConfig("first_block", threshold=0.85)
    one, s1, _ = _wan_ours(pipe, config, 6, 5.0, batched=True)
    two, s2, _ = _wan_ours(pipe, config, 6, 5.0, batched=False)
    np.testing.assert_allclose(one, two, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(s1["block_stack_runs"], s2["block_stack_runs"])


def test_calibration_ratios_equal_diffusers(wan, capsys):
    import torch
    from diffusers.hooks import MagCacheConfig

    pipe, reference, _ = wan
    shape = pipe.latent_shape(16, 16, 1)
    latents = initial_latents(SEEDS[0], shape)[None]
    cond, uncond, scales = pipe.conditioning(PROMPTS[:1], NEGATIVE[:1], [pipe.guidance(4.0)], 512)
    _, stats = pipe.sample_with_stats(
        latents, cond, uncond, num_inference_steps=6, cfg_scale=scales, cache=step_cache.CALIBRATE
    )
    capsys.readouterr()
    reference.transformer.enable_cache(MagCacheConfig(calibrate=True, num_inference_steps=6))
    try:
        reference(
            prompt=PROMPTS[0],
            negative_prompt=NEGATIVE[0],
            height=16,
            width=16,
            num_frames=1,
            num_inference_steps=6,
            guidance_scale=4.0,
            latents=torch.from_numpy(latents),
            output_type="np",
        )
    finally:
        reference.transformer.disable_cache()
    printed = re.findall(
        r"\[MagCache\] Calibration Complete.*?\n(\[.*?\])", capsys.readouterr().out
    )
    cond_ratios, uncond_ratios = (np.array(eval(text)) for text in printed)  # noqa: S307
    ratios = np.asarray(stats["ratios"])[0]
    np.testing.assert_allclose(ratios, cond_ratios, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(stats["negative_ratios"])[0], uncond_ratios, rtol=1e-4)
    assert ratios[0] == 1.0 and np.ptp(ratios[1:]) > 1e-3


FLUX_CASES = {
    "first_block_true_cfg": (step_cache.CacheConfig("first_block", threshold=0.8), 6, 3.0),
    "magcache_flux_ratios": (
        step_cache.CacheConfig(
            "magcache", threshold=0.1, mag_ratios=flux_family.MAG_RATIOS_28_STEPS
        ),
        8,
        1.0,
    ),
}


@pytest.mark.parametrize("case", list(FLUX_CASES))
def test_flux_caches_match_diffusers_hooks(flux, case):
    import torch

    config, steps, true_cfg = FLUX_CASES[case]
    pipe, reference, calls = flux
    shape = pipe.latent_shape(32, 32, 1)
    latents = np.stack([initial_latents(s, shape) for s in SEEDS])
    guidances = [pipe.guidance(3.5, true_cfg)] * 2
    cond, uncond, scales = pipe.conditioning(PROMPTS, NEGATIVE, guidances, 32)
    plan, schedule = _plan(config, steps)
    z, stats = pipe.sample_with_stats(
        latents,
        cond,
        uncond,
        num_inference_steps=steps,
        cfg_scale=scales,
        cache=plan,
        cache_schedule=schedule,
    )
    ours = np.asarray(pipe.decode(z))[:, 0]
    packed = np.asarray(flux_transformer.pack_latents(latents))
    theirs, runs = [], []
    for k in range(2):
        calls.clear()
        reference.transformer.enable_cache(_torch_config(config, steps))
        try:
            theirs.append(
                reference(
                    prompt=PROMPTS[k],
                    negative_prompt=NEGATIVE[k] if true_cfg > 1 else None,
                    true_cfg_scale=true_cfg,
                    guidance_scale=3.5,
                    height=32,
                    width=32,
                    num_inference_steps=steps,
                    latents=torch.from_numpy(packed[k : k + 1]),
                    max_sequence_length=32,
                    output_type="np",
                ).images[0]
            )
        finally:
            reference.transformer.disable_cache()
        runs.append(len(calls))
    branches = 2 if true_cfg > 1 else 1
    assert list(np.asarray(stats["block_stack_runs"])) == runs
    assert 0 < sum(runs) < 2 * branches * steps
    np.testing.assert_allclose(ours, np.stack(theirs), atol=TOLERANCE, rtol=0)


def test_magcache_schedule_follows_diffusers_rule():
    """The host-side schedule against a direct transcription of MagCacheHeadHook's rule run
    with torch float32 tensors, over many random ratio lists, steps and settings."""
    import torch
    from diffusers.hooks.mag_cache import nearest_interp

    rng = np.random.default_rng(0)
    for _ in range(200):
        length, steps = int(rng.integers(1, 30)), int(rng.integers(1, 40))
        ratios = (1.0 + rng.normal(0, 0.03, length)).round(5).tolist()
        threshold = float(rng.choice([0.0, 0.02, 0.06, 0.2]))
        max_skip, retention = int(rng.integers(0, 5)), float(rng.choice([0.0, 0.1, 0.2, 0.5]))
        ours = step_cache.magcache_schedule(ratios, steps, threshold, max_skip, retention)
        table = torch.tensor(ratios)
        if len(table) != steps:
            table = nearest_interp(table, steps)
        if length != steps:
            np.testing.assert_array_equal(step_cache.nearest_interp(ratios, steps), table.numpy())
        acc_ratio, acc_err, acc_steps, have, expected = 1.0, 0.0, 0, False, []
        for step in range(steps):
            compute = True
            if step >= int(retention * steps + 0.5):
                acc_ratio *= table[step] if step < len(table) else 1.0
                acc_steps += 1
                acc_err += abs(1.0 - acc_ratio)
                if have and acc_err <= threshold and acc_steps <= max_skip:
                    compute = False
                else:
                    acc_ratio, acc_err, acc_steps = 1.0, 0.0, 0
            have = have or compute
            expected.append(compute)
        np.testing.assert_array_equal(ours, expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "teacache"}, "cache.kind"),
        ({"kind": "magcache"}, "mag_ratios"),
        ({"kind": "magcache", "mag_ratios": (1.0,), "calibration": "gs://x"}, "exactly one"),
        ({"kind": "first_block", "mag_ratios": (1.0,)}, "for magcache"),
        ({"kind": "first_block", "threshold": -1.0}, "threshold"),
        ({"kind": "magcache", "mag_ratios": (1.0,), "retention_ratio": 2.0}, "retention_ratio"),
    ],
)
def test_bad_cache_configs_name_the_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        step_cache.CacheConfig(**kwargs)
