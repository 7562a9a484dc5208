"""The flux2 family's KV render vs diffusers ``Flux2KleinKVPipeline`` on a tiny random-init
pipeline (tests/support/tiny_flux2.py's Klein pipeline, saved by diffusers as that class:
:func:`kv_copy`), loaded by both from the folder.

diffusers' KV pipeline runs its first step in "extract" mode (the reference tokens beside the
noise tokens; noise and text queries see every key, reference queries only the reference keys,
the references modulated at the fixed timestep 0) and keeps the references' per-layer K/V, then
reuses them ("cached"). Ours computes that cache once per render inside the jitted loop, before
its first step (``Flux2Family.loop_conditioning``), and every step takes it.

Asserted (max |diff| on [0, 1] pixels, 1e-4): our KV render equals diffusers' from the same
latents with one and with two reference images of other sizes than the output's, and text-only;
our cached render equals our uncached evaluation of the same function (each step's call
recomputing the reference K/V at the same fixed timestep), and the compiled loop's step holds
no reference K/V matmul (they run once, before the loop); ``reference_kv=`` loads a Klein
folder as diffusers' ``Flux2KleinKVPipeline.from_pretrained`` of it renders, and a KV folder as
``Flux2KleinPipeline.from_pretrained`` of it does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend.core as jex
import numpy as np
import pytest

from jaxcore import families, sampling
from jaxcore.families import flux2, load_pipeline
from jaxcore.sampling import initial_latents
from tests.support.tiny_flux2 import build_flux2_pipeline, kv_copy

TOLERANCE = 1e-4
PROMPTS = ["a red fox in the snow", "blue square"]
HEIGHT, WIDTH = 20, 36  # 5 x 9 tokens, other sizes than the references'
STEPS = 3  # step 0 (diffusers' extract) and two cached steps
LENGTH = 32  # max_sequence_length


@pytest.fixture(scope="module")
def klein_folder(tmp_path_factory):
    """The tiny (non-distilled) Flux2KleinPipeline folder, built once."""
    return build_flux2_pipeline(tmp_path_factory.mktemp("flux2_klein"), seed=1)


@pytest.fixture(scope="module")
def kv_folder(klein_folder, tmp_path_factory):
    """The same components saved by diffusers as a Flux2KleinKVPipeline."""
    return kv_copy(klein_folder, tmp_path_factory.mktemp("flux2_klein_kv"))


@pytest.fixture(scope="module")
def kv(kv_folder):
    """(our Pipeline, diffusers' Flux2KleinKVPipeline) of the KV folder."""
    from diffusers import Flux2KleinKVPipeline

    return load_pipeline(kv_folder), Flux2KleinKVPipeline.from_pretrained(kv_folder)


def _images():
    """Two random RGB reference images, 70 x 90 and 100 x 66 (cropped to 68 x 88, 100 x 64)."""
    import PIL.Image

    rng = np.random.default_rng(7)
    return [
        PIL.Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for w, h in ((70, 90), (100, 66))
    ]


def _latents(pipe) -> np.ndarray:
    """The initial latents of seeds 3 and 4."""
    shape = pipe.latent_shape(HEIGHT, WIDTH, 1)
    return np.stack([initial_latents(seed, shape) for seed in (3, 4)])


def _ours(pipe, *, references=None, guidance=1.0) -> np.ndarray:
    """Our Pipeline API's render [B, H, W, 3] from :func:`_latents`."""
    images = None if references is None else [(list(references), None)] * len(PROMPTS)
    cond, uncond, scales = pipe.conditioning(
        PROMPTS,
        [""] * len(PROMPTS),
        [pipe.guidance(guidance)] * len(PROMPTS),
        LENGTH,
        images=images,
        size=(HEIGHT, WIDTH, 1),
    )
    z = pipe.sample(_latents(pipe), cond, uncond, num_inference_steps=STEPS, cfg_scale=scales)
    return np.asarray(pipe.decode(z))[:, 0]


def _theirs(pipe, latents, *, references=None, **kwargs) -> np.ndarray:
    """diffusers' render [B, H, W, 3] from the same latents (the KV pipeline takes no
    guidance_scale; ``kwargs`` give Flux2KleinPipeline's)."""
    import torch

    return pipe(
        image=None if references is None else list(references),
        prompt=PROMPTS,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=STEPS,
        latents=torch.from_numpy(latents),
        max_sequence_length=LENGTH,
        output_type="np",
        **kwargs,
    ).images


def _assert_equal(ours, theirs):
    """Same shape, a non-flat reference, and equal within TOLERANCE."""
    assert ours.shape == theirs.shape == (len(PROMPTS), HEIGHT, WIDTH, 3)
    assert theirs.std() > 0.05  # not a flat (saturated) image
    np.testing.assert_allclose(ours, theirs, atol=TOLERANCE, rtol=0)


def test_loads_as_the_kv_render(kv):
    """model_index.json's class turns the KV render on, with its defaults and no CFG (a
    guidance_scale is ignored, as for a distilled pipeline: the stage's default is 5)."""
    ours, _ = kv
    assert ours.family.name == "flux2" and ours.configs["pipeline"].reference_kv
    defaults = ours.family.sampling_defaults(ours.configs)
    assert (defaults["num_inference_steps"], defaults["guidance_scale"]) == (4, 1.0)
    assert not ours.guidance(1.0).uses_cfg and not ours.guidance(4.0).uses_cfg
    cond = ours.family.encode_images(ours, [(_images()[:1], None)], HEIGHT, WIDTH, 1)
    assert sorted(cond) == ["kv_reference_0"]


@pytest.mark.parametrize("count", [1, 2], ids=["one-reference", "two-references"])
def test_editing_matches_diffusers(kv, count):
    """1 or 2 reference images (other sizes than the output's) per prompt."""
    references = _images()[:count]
    ours = _ours(kv[0], references=references)
    _assert_equal(ours, _theirs(kv[1], _latents(kv[0]), references=references))
    plain = _ours(kv[0])
    assert np.abs(plain - ours).max() > 1e-3  # the references matter


def test_text_only_matches_diffusers(kv):
    """No reference image: the KV pipeline's plain forward, no CFG (guidance_scale ignored)."""
    _assert_equal(_ours(kv[0], guidance=4.0), _theirs(kv[1], _latents(kv[0])))


class _UncachedKV(flux2.Flux2Family):
    """The flux2 family without the once-per-render cache: every step's call computes the
    references' K/V itself (``apply`` given ``kv_reference_<i>``), at the same fixed timestep."""

    def loop_conditioning(self, module, params, conditioning):
        del module, params
        return conditioning


def _dot_count(jaxpr) -> int:
    """dot_general equations in ``jaxpr`` and every jaxpr nested in it."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == "dot_general"
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if isinstance(sub, jex.ClosedJaxpr):
                    count += _dot_count(sub.jaxpr)
                elif isinstance(sub, jex.Jaxpr):
                    count += _dot_count(sub)
    return count


def _loop_dots(pipe, monkeypatch, references) -> tuple[np.ndarray, int, int]:
    """(render, matmuls per step, matmuls outside the loop) of one render: the loop's jaxpr
    taken as the render calls its jitted program."""
    seen = {}
    jitted = sampling._jitted

    def spy(loop):
        fn = jitted(loop)

        def run(*args):
            seen["jaxpr"] = jax.make_jaxpr(functools.partial(sampling.denoise, loop))(*args)
            return fn(*args)

        return run

    monkeypatch.setattr(sampling, "_jitted", spy)
    render = _ours(pipe, references=references)
    monkeypatch.undo()
    jaxpr = seen["jaxpr"].jaxpr
    (loop,) = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "while"]
    per_step = _dot_count(loop.params["body_jaxpr"].jaxpr)
    return render, per_step, _dot_count(jaxpr) - per_step


def test_cached_render_equals_the_uncached_one(kv, monkeypatch):
    """The cache computed once per render = the reference K/V recomputed every step; the
    cached step runs the text-only step's matmuls (the cache's run once, before the loop)."""
    pipe, references = kv[0], _images()
    cached, cached_step, cached_once = _loop_dots(pipe, monkeypatch, references)
    uncached_pipe = dataclasses.replace(pipe, family=_UncachedKV())
    uncached, uncached_step, uncached_once = _loop_dots(uncached_pipe, monkeypatch, references)
    _, text_step, text_once = _loop_dots(pipe, monkeypatch, None)
    np.testing.assert_allclose(cached, uncached, atol=TOLERANCE, rtol=0)
    assert cached_step == text_step < uncached_step
    assert text_once == uncached_once == 0 < cached_once


def test_reference_kv_load_option_follows_diffusers(klein_folder, kv_folder):
    """``reference_kv=true`` on a Klein folder renders as Flux2KleinKVPipeline.from_pretrained
    of it; ``reference_kv=false`` on a KV folder as Flux2KleinPipeline.from_pretrained of it
    (CFG at guidance 4: the folder names no is_distilled)."""
    from diffusers import Flux2KleinKVPipeline, Flux2KleinPipeline

    references = _images()[:1]
    opted_in = load_pipeline(klein_folder, reference_kv=True)
    assert opted_in.configs["pipeline"].reference_kv
    ours = _ours(opted_in, references=references)
    theirs = Flux2KleinKVPipeline.from_pretrained(klein_folder)
    _assert_equal(ours, _theirs(theirs, _latents(opted_in), references=references))

    opted_out = load_pipeline(kv_folder, reference_kv=False)
    assert not opted_out.configs["pipeline"].reference_kv
    ours = _ours(opted_out, references=references, guidance=4.0)
    theirs = Flux2KleinPipeline.from_pretrained(kv_folder)
    latents = _latents(opted_out)
    _assert_equal(ours, _theirs(theirs, latents, references=references, guidance_scale=4.0))
    with pytest.raises(families.FamilyError, match="reference_kv must be true or false"):
        load_pipeline(klein_folder, reference_kv="yes")
