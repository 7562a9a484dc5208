"""Step caching (jaxcore/step_cache.py) for the flux2 family vs diffusers' cache hooks.

A tiny random-init Klein pipeline (tests/support/tiny_flux2.py) renders with First-Block-Cache
and MagCache through our Pipeline API and in diffusers (``Flux2KleinPipeline`` /
``Flux2KleinKVPipeline`` with ``transformer.enable_cache(...)``) from the same latents; the
skip decisions must be the same (block-stack evaluations, counted in diffusers by a hook on the
last single block's attention, which runs only when the stack is computed) and the pixels equal
within 1e-4 on [0, 1]. diffusers renders one prompt per call (its cache contexts "cond" /
"uncond" are the two CFG branches of that call); ours renders both prompts in one batch whose
rows decide alone.

What the hooks compare on Flux.2: the first double block's ``hidden_states`` is the image
stream (with the non-KV render's reference tokens after the latents'), so the first-block
residual and MagCache's residual are over it; the last single block returns the joint
[text; image] sequence, whose image tokens sit at the end.

diffusers 0.42.1's First-Block-Cache tail hook cannot take that joint output (it subtracts the
head's [image, text] output list from one tensor: a TypeError, asserted below so that the patch
goes when diffusers fixes it). The reference here patches only that line, splitting the tail's
residual the way MagCache's tail does (image tokens at the end, text before them); the head's
decision and the skip path are diffusers' own.

The tiny random model changes fast between steps, so the First-Block thresholds are large.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxcore import step_cache
from jaxcore.families import load_pipeline
from jaxcore.sampling import initial_latents
from tests.support.tiny_flux2 import build_flux2_pipeline, kv_copy

TOLERANCE = 1e-4
PROMPTS = ["a red fox in the snow", "blue square"]
HEIGHT, WIDTH = 20, 36  # 5 x 9 tokens
LENGTH = 32  # max_sequence_length
RATIOS = (1.0, 1.02, 0.99, 1.01, 1.0, 0.96)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_flux2_pipeline(tmp_path_factory.mktemp("flux2_klein"), seed=1)


@pytest.fixture(scope="module")
def klein(folder):
    """(our Pipeline, diffusers' Flux2KleinPipeline, its stack-run counter)."""
    from diffusers import Flux2KleinPipeline

    reference = Flux2KleinPipeline.from_pretrained(folder)
    return load_pipeline(folder), reference, _count_stack_runs(reference)


@pytest.fixture(scope="module")
def kv(folder, tmp_path_factory):
    """(our KV Pipeline, diffusers' Flux2KleinKVPipeline, its stack-run counter)."""
    from diffusers import Flux2KleinKVPipeline

    directory = kv_copy(folder, tmp_path_factory.mktemp("flux2_klein_kv"))
    reference = Flux2KleinKVPipeline.from_pretrained(directory)
    return load_pipeline(directory), reference, _count_stack_runs(reference)


@pytest.fixture
def fused_tail(monkeypatch):
    """diffusers' First-Block-Cache with the tail residual split for a joint tail output."""
    from diffusers.hooks import first_block_cache

    original = first_block_cache.FBCBlockHook.new_forward

    def new_forward(self, module, *args, **kwargs):
        state = self.state_manager.get_state()
        if not (self.is_tail and state.should_compute):
            return original(self, module, *args, **kwargs)
        output = self.fn_ref.original_forward(*args, **kwargs)
        image, text = state.head_block_output
        length = image.shape[1]
        assert output.shape[1] == text.shape[1] + length  # the joint [text; image] sequence
        state.tail_block_residuals = (output[:, -length:] - image, output[:, :-length] - text)
        return output

    monkeypatch.setattr(first_block_cache.FBCBlockHook, "new_forward", new_forward)


def _count_stack_runs(reference) -> list:
    calls: list = []
    tail = reference.transformer.single_transformer_blocks[-1].attn
    tail.register_forward_hook(lambda *args: calls.append(1))
    return calls


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


def _images(count: int):
    """``count`` random RGB reference images (70 x 90, 100 x 66)."""
    import PIL.Image

    rng = np.random.default_rng(7)
    sizes = ((70, 90), (100, 66))[:count]
    return [PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)) for w, h in sizes]


def _ours(pipe, config, steps, guidance, references=None):
    """Our render [B, H, W, 3] (cached by ``config``; None: dense), stack runs per prompt,
    the latents."""
    shape = pipe.latent_shape(HEIGHT, WIDTH, 1)
    latents = np.stack([initial_latents(seed, shape) for seed in (3, 4)])
    images = None if references is None else [(list(references), None)] * len(PROMPTS)
    cond, uncond, scales = pipe.conditioning(
        PROMPTS,
        [""] * len(PROMPTS),
        [pipe.guidance(guidance)] * len(PROMPTS),
        LENGTH,
        images=images,
        size=(HEIGHT, WIDTH, 1),
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
    runs = None if config is None else [int(r) for r in np.asarray(stats["block_stack_runs"])]
    return np.asarray(pipe.decode(z))[:, 0], runs, latents


def _theirs(reference, calls, config, steps, latents, references=None, **kwargs):
    """diffusers, one prompt per call: (images [B, H, W, 3], stack runs per prompt)."""
    import torch

    images, runs = [], []
    for k in range(len(PROMPTS)):
        calls.clear()
        reference.transformer.enable_cache(_torch_config(config, steps))
        try:
            out = reference(
                image=None if references is None else list(references),
                prompt=PROMPTS[k],
                height=HEIGHT,
                width=WIDTH,
                num_inference_steps=steps,
                latents=torch.from_numpy(latents[k : k + 1]),
                max_sequence_length=LENGTH,
                output_type="np",
                **kwargs,
            ).images
        finally:
            reference.transformer.disable_cache()
        images.append(out[0])
        runs.append(len(calls))
    return np.stack(images), runs


def _assert_same(ours, our_runs, theirs, their_runs, most: int):
    """Same decisions, some skipped and some computed, and the same pixels."""
    assert our_runs == their_runs
    assert 0 < sum(our_runs) < most
    assert theirs.std() > 0.05  # not a flat (saturated) image
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0)


KLEIN_CASES = {
    # (config, steps, guidance, reference images)
    "first_block_cfg": (step_cache.CacheConfig("first_block", threshold=1.0), 6, 4.0, 0),
    "first_block_reference": (step_cache.CacheConfig("first_block", threshold=1.0), 6, 4.0, 1),
    "magcache_cfg": (step_cache.CacheConfig("magcache", mag_ratios=RATIOS), 6, 4.0, 0),
    "magcache_reference": (step_cache.CacheConfig("magcache", mag_ratios=RATIOS), 6, 1.0, 1),
}


@pytest.mark.parametrize("case", list(KLEIN_CASES))
def test_klein_caches_match_diffusers_hooks(klein, fused_tail, case):
    """Flux2KleinPipeline: CFG (two cache contexts per prompt) and reference images (their
    tokens join the image stream, hence the residuals)."""
    config, steps, guidance, count = KLEIN_CASES[case]
    pipe, reference, calls = klein
    references = _images(count) if count else None
    ours, our_runs, latents = _ours(pipe, config, steps, guidance, references)
    theirs, their_runs = _theirs(
        reference, calls, config, steps, latents, references, guidance_scale=guidance
    )
    branches = 2 if guidance > 1 else 1
    _assert_same(ours, our_runs, theirs, their_runs, len(PROMPTS) * branches * steps)


def test_kv_magcache_matches_diffusers_hooks(kv):
    """Flux2KleinKVPipeline (no CFG): the references join every layer's keys, the image
    stream is the latents' alone. diffusers' first ("extract") step carries the reference
    tokens in its image stream, so its residual covers them; a retention of two steps makes the
    second step compute and replace it before any skip (after that both are the same)."""
    config = step_cache.CacheConfig("magcache", mag_ratios=RATIOS, retention_ratio=0.34)
    pipe, reference, calls = kv
    references = _images(1)
    ours, our_runs, latents = _ours(pipe, config, 6, 1.0, references)
    theirs, their_runs = _theirs(reference, calls, config, 6, latents, references)
    assert list(step_cache.schedule_for(config, RATIOS, 6)) == [1, 1, 0, 0, 0, 1]
    _assert_same(ours, our_runs, theirs, their_runs, len(PROMPTS) * 6)


def test_kv_first_block_computing_every_step_is_the_dense_render(kv):
    """First-Block-Cache on the KV render: at threshold 0 every step computes (the first
    block's residual always changes), through the split stack (first block, then the rest),
    and the render equals the dense one; at a large threshold steps skip and it differs."""
    pipe = kv[0]
    references = _images(1)
    dense, _, _ = _ours(pipe, None, 4, 1.0, references)
    every, runs, _ = _ours(
        pipe, step_cache.CacheConfig("first_block", threshold=0.0), 4, 1.0, references
    )
    assert runs == [4, 4]
    np.testing.assert_allclose(every, dense, atol=1e-5, rtol=0)
    skipping, runs, _ = _ours(
        pipe, step_cache.CacheConfig("first_block", threshold=1.0), 4, 1.0, references
    )
    assert 0 < sum(runs) < 8
    assert np.abs(skipping - dense).max() > 1e-3


def test_diffusers_first_block_cache_fails_on_flux2_unpatched(klein):
    """The reason for :func:`fused_tail`: diffusers' own tail hook raises on Flux.2. When this
    fails, diffusers handles the joint tail itself: compare against it unpatched."""
    config = step_cache.CacheConfig("first_block", threshold=0.5)
    _, reference, calls = klein
    shape = klein[0].latent_shape(HEIGHT, WIDTH, 1)
    latents = initial_latents(3, shape)[None]
    with pytest.raises(TypeError, match="Tensor"):
        _theirs(reference, calls, config, 2, np.concatenate([latents, latents]))


def _ids(*axes) -> np.ndarray:
    """[L, 4] (t, h, w, l) position ids."""
    return np.stack(axes, 1).astype(np.float32)


@pytest.mark.parametrize(
    "scan, with_kv",
    [(False, False), (True, False), (False, True)],  # reference K/V run the loop, never a scan
    ids=["loop", "scan_layers", "reference_kv"],
)
def test_a_stack_run_in_pieces_equals_one_run(scan, with_kv):
    """The transformer's ``run_blocks`` split at every block (k = 1..N-1: inside the double
    blocks, at the double/single boundary, inside the single blocks) equals the plain call
    (1e-6), in the plain loop and scanned, with and without reference K/V; and the text
    stream that ``run_stack`` returns does not reach the output (what a skipped step returns
    for it is free)."""
    import jax
    import jax.numpy as jnp

    from jaxcore.models import flux2_transformer as f2

    config = f2.Flux2TransformerConfig.from_dict(
        dict(
            in_channels=16,
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=24,
            timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4),
            guidance_embeds=False,
        )
    )
    rng = np.random.default_rng(0)
    args = (
        rng.standard_normal((2, 15, 16), np.float32),
        rng.standard_normal((2, 6, 24), np.float32),
        np.array([0.9, 0.3], np.float32),
        _ids(np.zeros(15), np.arange(15) // 5, np.arange(15) % 5, np.zeros(15)),
        _ids(*[np.zeros(6)] * 3, np.arange(6)),
    )
    module = f2.Flux2Transformer(config, scan_layers=scan)
    params = f2.Flux2Transformer(config).init(jax.random.PRNGKey(0), *args)["params"]
    extra = {}
    if with_kv:
        refs = rng.standard_normal((1, 4, 16), np.float32)
        ref_ids = _ids(np.full(4, 10), np.arange(4) // 2, np.arange(4) % 2, np.zeros(4))
        extra["reference_kv"] = module.apply(
            {"params": params}, refs, ref_ids, method="reference_kv"
        )
    plain = module.apply({"params": params}, *args, **extra)
    total = config.num_layers + config.num_single_layers
    for k in range(1, total):

        def in_pieces(streams, run_blocks, num_blocks, k=k):
            assert num_blocks == total
            head = run_blocks(streams, 0, k)
            assert [s.shape for s in head] == [s.shape for s in streams]
            return run_blocks(head, k, num_blocks), None

        out, _ = module.apply({"params": params}, *args, **extra, run_stack=in_pieces)
        np.testing.assert_allclose(out, plain, atol=1e-6, rtol=0)

    def text_replaced(streams, run_blocks, num_blocks):
        image, text = run_blocks(streams, 0, num_blocks)
        return (image, jnp.zeros_like(text)), None

    out, _ = module.apply({"params": params}, *args, **extra, run_stack=text_replaced)
    np.testing.assert_array_equal(out, plain)
    assert np.abs(plain).max() > 0.1


def test_flux2_dev_magcache_matches_diffusers_hooks(tmp_path):
    """FLUX.2 [dev] (flux2_dev inherits the family's apply): embedded guidance, no CFG, vs
    diffusers' Flux2Pipeline (one cache context: MagCache's own)."""
    from tests.support.tiny_flux2_dev import build_flux2_dev_pipeline, reference_pipeline

    directory = build_flux2_dev_pipeline(tmp_path / "flux2_dev", seed=1)
    pipe, reference = load_pipeline(directory), reference_pipeline(directory)
    calls = _count_stack_runs(reference)
    config = step_cache.CacheConfig("magcache", mag_ratios=RATIOS)
    ours, our_runs, latents = _ours(pipe, config, 6, 4.0)
    theirs, their_runs = _theirs(reference, calls, config, 6, latents, guidance_scale=4.0)
    _assert_same(ours, our_runs, theirs, their_runs, len(PROMPTS) * 6)
