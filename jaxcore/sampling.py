"""The sampling loop, shared by every family: a scheduler and guidance around any denoiser.

At each scheduler timestep the family's denoiser predicts (:meth:`Family.apply`); with
classifier-free guidance a second pass on the negative conditioning gives
``uncond + scale * (cond - uncond)`` (diffusers' formula for Wan's ``guidance_scale`` and
Flux's ``true_cfg_scale``), applied per sample only where its scale is > 1; the scheduler steps
the latents. The whole loop is ONE jitted function (``lax.fori_loop`` with the scheduler state
in the carry), compiled once per (family, denoiser module(s), scheduler, CFG on/off, shapes).

Two experts (Wan 2.2 A14B, diffusers' ``transformer`` + ``transformer_2``): the first expert
predicts while the timestep is ``>= boundary`` (high noise), the second below it, each with its
own guidance scale; the switch is a ``lax.cond`` inside the same loop (no recompilation, no
host sync). Whether CFG runs at all follows the first scale, as in diffusers
(``do_classifier_free_guidance`` reads ``guidance_scale`` only). The loop can also run a range
of steps (``start``, ``stop``), which is how the idle expert's weights can stay on the host: one
range per expert, the weights swapped in between (:meth:`jaxcore.pipeline.Pipeline.sample`).

With CFG the two branches run as one denoiser call on ``[cond; uncond]`` (2B rows; with a
``data`` mesh axis they spread over its devices) unless ``batched_cfg`` is off (two calls);
the result equals two calls within fp32 round-off. Step caching (:mod:`jaxcore.step_cache`:
First-Block-Cache, MagCache, calibration) runs inside the same loop, its state in the carry.
What the denoiser's calls need from the weights and the conditioning but not from the step
(Flux.2 [klein] KV's reference keys and values) is made once in the same program, before the
loop (:meth:`Family.loop_conditioning`), and every step takes it.

Initial noise is drawn per prompt from its seed alone (:func:`initial_latents`), never from a
batch-level key, so outputs do not depend on batch composition, batch size or device count.

Classic (DDPM-trained) samplers: the denoiser sees ``scale_model_input(state, x)`` (Euler's
``x / sqrt(sigma^2 + 1)``; the identity for every other sampler, the flow ones included), the
step gets the unscaled ``x``; the caller multiplies the initial latents by
``init_noise_sigma(state)`` (:mod:`jaxcore.schedulers`). Guidance rescale (diffusers'
``guidance_rescale``, :func:`rescale_guidance`) runs per sample after CFG where it is > 0.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import control, quantization, schedulers, step_cache


def initial_latents(seed: int, shape: Sequence[int]) -> np.ndarray:
    """Standard-normal float32 noise of ``shape`` that depends on ``seed`` alone.

    numpy's PCG64 generator on the host: the same numbers on every machine, device count and
    batch layout (a device-side key split per batch would tie noise to batch composition).
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return np.random.Generator(np.random.PCG64(seed)).standard_normal(shape, np.float32)


def initial_latent_parts(seed: int, shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Standard-normal float32 noise of each of ``shapes``, drawn in turn from one generator
    seeded by ``seed`` (the first part is :func:`initial_latents` of its shape): the noise of a
    render whose latents hold several arrays (video and audio), each a function of the seed
    alone whether or not the prompt gives the others."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    generator = np.random.Generator(np.random.PCG64(seed))
    return [generator.standard_normal(tuple(shape), np.float32) for shape in shapes]


def to_uint8(video: np.ndarray) -> np.ndarray:
    """[0, 1] float frames -> uint8 (round to nearest, as diffusers' ``numpy_to_pil``)."""
    return np.clip(np.round(np.asarray(video) * 255.0), 0, 255).astype(np.uint8)


def boundary_timestep(boundary_ratio: float, num_train_timesteps: int) -> np.float32:
    """diffusers' ``boundary_ratio * num_train_timesteps`` as the comparison sees it.

    diffusers compares a scheduler timestep tensor (int64 or float32) with this Python float,
    and torch's type promotion does it in float32: 0.9 * 1000 = 900.0000000000001 becomes 900.0,
    so t = 900 goes to the first expert. Rounding to float32 here keeps that.
    """
    return np.float32(boundary_ratio * num_train_timesteps)


def first_expert_steps(timesteps, boundary: float) -> int:
    """How many leading steps the first (high-noise) expert runs (timesteps decrease)."""
    t = np.asarray(timesteps, np.float32)
    return int(np.sum(t >= np.float32(boundary)))


def rescale_guidance(guided: jax.Array, cond_prediction: jax.Array, rescale: jax.Array):
    """diffusers' ``rescale_noise_cfg`` (Lin et al., "Common Diffusion Noise Schedules and
    Sample Steps are Flawed", arXiv 2305.08891, section 3.4): per sample, scale the CFG result
    to the standard deviation of the conditional prediction, then mix ``rescale`` of that with
    ``1 - rescale`` of the CFG result. Standard deviations are over every non-batch axis with
    Bessel's correction (torch's ``Tensor.std``); ``rescale`` broadcasts per sample."""
    axes = tuple(range(1, guided.ndim))
    std_cond = jnp.std(cond_prediction, axis=axes, keepdims=True, ddof=1)
    std_guided = jnp.std(guided, axis=axes, keepdims=True, ddof=1)
    rescaled = guided * (std_cond / std_guided)
    return rescale * rescaled + (1 - rescale) * guided


@dataclasses.dataclass(frozen=True)
class Loop:
    """What a compiled denoising loop is made of (see :func:`denoise_fn`); hashable, so one
    compiled loop serves every call with the same parts."""

    family: object
    module: object
    step_fn: object
    use_cfg: bool
    second_module: object = None
    cache: step_cache.CachePlan = step_cache.NO_CACHE
    batched_cfg: bool = False
    # compute.quantization=int8 / fp8: the quantized kernels go into the denoiser as they are
    # (its products run quantized); otherwise they are dequantized first (see guided)
    quantized_products: bool = False


def denoise_fn(
    family,
    module,
    step_fn,
    use_cfg: bool,
    second_module=None,
    cache: step_cache.CachePlan = step_cache.NO_CACHE,
    batched_cfg: bool = False,
    quantized_products: bool = False,
):
    """jit(params, latents, cond, uncond, cfg_on[B], cfg_scale[B], state, start, stop, second,
    cache_in, rescale=None) -> (latents, state, cache_out) after the steps ``start <= i < stop``.

    ``cond``/``uncond`` are dicts of conditioning tensors (``uncond`` is ignored without CFG);
    ``cfg_on`` says per sample whether CFG applies at all (diffusers: the first expert's scale
    is > 1), ``cfg_scale`` is the scale applied; ``state`` is a scheduler state whose
    ``timesteps`` the loop walks. ``second`` is ``None`` for one denoiser, else
    ``(params_2, boundary, cfg_scale_2[B])`` for ``second_module``.

    ``batched_cfg``: the conditional and negative branches run as one batch of 2B (else two
    calls). ``cache`` (:mod:`jaxcore.step_cache`): with a cache, ``cache_in`` is
    ``{"state": a cache state or None (a fresh one), "schedule": [N] bool or None}`` and
    ``cache_out`` ``{"state", "ratios": [N, rows] (calibration) or None}``; the state's rows
    are the denoiser calls' rows (``[cond; uncond]`` batched, a pair of states otherwise).

    ``rescale``: None, or ``[B]`` guidance-rescale factors applied after CFG where both CFG is
    on and the factor is > 0 (:func:`rescale_guidance`); None traces no rescaling at all. The
    denoiser is fed ``schedulers.scale_model_input(state, x)`` at every step.
    """
    if cache.enabled and second_module is not None:
        raise ValueError("step caching is not supported with two experts yet")
    # one cache key however the call spelled its defaults
    return _jitted(
        Loop(
            family, module, step_fn, use_cfg, second_module, cache, batched_cfg, quantized_products
        )
    )


@functools.lru_cache(maxsize=32)
def _jitted(loop: Loop):
    return jax.jit(functools.partial(denoise, loop))


def denoise(
    loop: Loop,
    params,
    latents,
    cond,
    uncond,
    cfg_on_b,
    cfg_scale_b,
    state,
    start,
    stop,
    second,
    cache_in,
    rescale_b=None,
):
    """The steps ``start <= i < stop`` of ``loop`` as one ``fori_loop`` (:func:`denoise_fn`
    gives the arguments' meaning)."""
    batch = latents.shape[0]
    guidance = per_sample_guidance(latents, cfg_on_b, cfg_scale_b, rescale_b)
    cond, uncond = prepared_conditioning(loop, params, cond, uncond)
    schedule = cstate = ratios = None
    if loop.cache.enabled:
        schedule, cstate = cache_in["schedule"], cache_in["state"]
        if cstate is None:
            t0 = jnp.broadcast_to(state.timesteps[0].astype(jnp.float32), (batch,))
            cstate = fresh_cache_state(loop, params, latents, t0, cond, uncond)
        if loop.cache.kind == "calibrate":
            rows = batch * (2 if loop.use_cfg else 1)
            ratios = jnp.zeros((state.timesteps.shape[0], rows), jnp.float32)

    def body(i, carry):
        return loop_step(loop, params, cond, uncond, guidance, second, schedule, i, carry)

    x, state, cstate, ratios = jax.lax.fori_loop(
        start, stop, body, (latents, state, cstate, ratios)
    )
    return x, state, ({"state": cstate, "ratios": ratios} if loop.cache.enabled else None)


def prepared_conditioning(loop: Loop, params, cond, uncond):
    """Both branches' conditioning as every step's denoiser call takes it
    (:meth:`Family.loop_conditioning`, once per loop run, before its first step); the negative
    branch only where CFG runs (it is ignored otherwise)."""
    weights = _for_denoiser(loop, params, loop.module)
    cond = loop.family.loop_conditioning(loop.module, weights, cond)
    if loop.use_cfg:
        uncond = loop.family.loop_conditioning(loop.module, weights, uncond)
    return cond, uncond


@dataclasses.dataclass(frozen=True)
class PerSampleCfg:
    """Per-sample CFG settings broadcast against the latents: ``cfg_on`` (apply CFG at all),
    ``scale``, and ``rescale`` (None, or (where it applies, the factor))."""

    cfg_on: jax.Array
    scale: jax.Array
    rescale: tuple | None


def per_sample_guidance(latents, cfg_on_b, cfg_scale_b, rescale_b) -> PerSampleCfg:
    per_sample = (latents.shape[0],) + (1,) * (latents.ndim - 1)
    cfg_on = cfg_on_b.reshape(per_sample)
    rescale = None
    if rescale_b is not None:
        factor = rescale_b.reshape(per_sample).astype(jnp.float32)
        rescale = (cfg_on & (factor > 0), factor)
    return PerSampleCfg(cfg_on, cfg_scale_b.reshape(per_sample), rescale)


def loop_step(loop: Loop, params, cond, uncond, guidance, second, schedule, i, carry):
    """One step: the (guided) prediction at the step's timestep, then the scheduler's update.
    A two-expert loop asks the second expert below ``boundary``."""
    x, st, cs, rs = carry
    cond, uncond = control.at_step(cond, i), control.at_step(uncond, i)  # ControlNet scales
    batch = x.shape[0]
    t_now = st.timesteps[i].astype(jnp.float32)
    t = jnp.broadcast_to(t_now, (batch,))
    compute_now = None if schedule is None else schedule[i]
    x_in = schedulers.scale_model_input(st, x)  # x itself for all but Euler
    if second is None:
        prediction, cs, info = guided(
            loop, loop.module, params, x_in, t, cond, uncond, guidance, cs, compute_now
        )
    else:
        params_2, boundary, cfg_scale_2_b = second
        guidance_2 = dataclasses.replace(
            guidance, scale=cfg_scale_2_b.reshape(guidance.scale.shape)
        )
        prediction, cs, info = jax.lax.cond(
            t_now >= boundary,
            lambda: guided(loop, loop.module, params, x_in, t, cond, uncond, guidance, cs, None),
            lambda: guided(
                loop, loop.second_module, params_2, x_in, t, cond, uncond, guidance_2, cs, None
            ),
        )
    if rs is not None:
        rs = rs.at[i].set(info)
    x, st = loop.step_fn(st, prediction, x)
    return x, st, cs, rs


def guided(
    loop: Loop, mod, params, x, t, cond, uncond, guidance: PerSampleCfg, cstate, compute_now
):
    """The prediction with classifier-free guidance where it is on: ``negative + scale *
    (prediction - negative)`` per sample (diffusers applies CFG only when the first scale is
    > 1), then the guidance rescale; the branches batched as 2B rows or as two calls.
    Quantized kernels (``compute.quantization``) are dequantized to the weights' dtype here,
    once for both branches, unless the loop runs its products quantized."""
    params = _for_denoiser(loop, params, mod)
    if not loop.use_cfg:
        return call(loop, mod, params, x, t, cond, cstate, compute_now)
    if loop.batched_cfg:
        both, cstate, info = call(
            loop,
            mod,
            params,
            jnp.concatenate([x, x], axis=0),
            jnp.concatenate([t, t], axis=0),
            stacked(cond, uncond),
            cstate,
            compute_now,
        )
        prediction, negative = jnp.split(both, 2, axis=0)
    else:
        first, second = cstate if loop.cache.enabled else (None, None)
        prediction, first, info_c = call(loop, mod, params, x, t, cond, first, compute_now)
        negative, second, info_u = call(loop, mod, params, x, t, uncond, second, compute_now)
        cstate = (first, second) if loop.cache.enabled else cstate
        info = None if info_c is None else jnp.concatenate([info_c, info_u])
    mixed = jnp.where(
        guidance.cfg_on, negative + guidance.scale * (prediction - negative), prediction
    )
    if guidance.rescale is not None:
        on, factor = guidance.rescale
        mixed = jnp.where(on, rescale_guidance(mixed, prediction, factor), mixed)
    return mixed, cstate, info


def _for_denoiser(loop: Loop, params, mod):
    """The weights the denoiser takes: quantized kernels as they are for quantized products,
    else dequantized to ``mod``'s parameter dtype."""
    return quantization.for_denoiser(params, loop.quantized_products, mod.param_dtype)


def call(loop: Loop, mod, params, x, t, conditioning, cstate, compute_now):
    """One denoiser call in float32; with a step cache, through the cache's block runner
    (returns the new cache state and what the cache measured)."""
    if not loop.cache.enabled:
        return loop.family.apply(mod, params, x, t, conditioning).astype(jnp.float32), cstate, None
    run = step_cache.runner(loop.cache, cstate, compute_now)
    prediction, (cstate, info) = loop.family.apply(mod, params, x, t, conditioning, run_stack=run)
    return prediction.astype(jnp.float32), cstate, info


def stacked(cond, uncond):
    """The two branches' conditioning as one batch ``[cond; uncond]``."""
    if set(cond) != set(uncond):
        raise ValueError(
            f"batched CFG needs the same conditioning names in both branches, got "
            f"{sorted(cond)} and {sorted(uncond)}"
        )
    return {k: jnp.concatenate([cond[k], uncond[k]], axis=0) for k in cond}


def fresh_cache_state(loop: Loop, params, x, t, cond, uncond):
    """A step-cache state sized by the streams the denoiser's block stack carries."""

    def probe(streams, run_blocks, num_blocks):
        return run_blocks(streams, 0, num_blocks), streams

    def shapes(rows_x, rows_t, conditioning):
        def apply():
            weights = _for_denoiser(loop, params, loop.module)
            return loop.family.apply(
                loop.module, weights, rows_x, rows_t, conditioning, run_stack=probe
            )

        return jax.eval_shape(apply)[1]

    if loop.use_cfg and loop.batched_cfg:
        two = shapes(jnp.concatenate([x, x]), jnp.concatenate([t, t]), stacked(cond, uncond))
        return step_cache.init_state(loop.cache, two)
    one = step_cache.init_state(loop.cache, shapes(x, t, cond))
    return (one, one) if loop.use_cfg else one
