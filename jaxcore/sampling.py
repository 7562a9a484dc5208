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

Initial noise is drawn per prompt from its seed alone (:func:`initial_latents`), never from a
batch-level key, so outputs do not depend on batch composition, batch size or device count.

Classic (DDPM-trained) samplers: the denoiser sees ``scale_model_input(state, x)`` (Euler's
``x / sqrt(sigma^2 + 1)``; the identity for every other sampler, the flow ones included), the
step gets the unscaled ``x``; the caller multiplies the initial latents by
``init_noise_sigma(state)`` (:mod:`jaxcore.schedulers`). Guidance rescale (diffusers'
``guidance_rescale``, :func:`rescale_guidance`) runs per sample after CFG where it is > 0.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore import schedulers, step_cache


def initial_latents(seed: int, shape: Sequence[int]) -> np.ndarray:
    """Standard-normal float32 noise of ``shape`` that depends on ``seed`` alone.

    numpy's PCG64 generator on the host: the same numbers on every machine, device count and
    batch layout (a device-side key split per batch would tie noise to batch composition).
    """
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return np.random.Generator(np.random.PCG64(seed)).standard_normal(shape, np.float32)


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


@functools.lru_cache(maxsize=32)
def denoise_fn(
    family,
    module,
    step_fn,
    use_cfg: bool,
    second_module=None,
    cache: step_cache.CachePlan = step_cache.NO_CACHE,
    batched_cfg: bool = False,
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

    def call(mod, params, x, t, conditioning, cstate, compute_now):
        if not cache.enabled:
            return family.apply(mod, params, x, t, conditioning).astype(jnp.float32), cstate, None
        run = step_cache.runner(cache, cstate, compute_now)
        prediction, (cstate, info) = family.apply(mod, params, x, t, conditioning, run_stack=run)
        return prediction.astype(jnp.float32), cstate, info

    def stacked(cond, uncond):
        if set(cond) != set(uncond):
            raise ValueError(
                f"batched CFG needs the same conditioning names in both branches, got "
                f"{sorted(cond)} and {sorted(uncond)}"
            )
        return {k: jnp.concatenate([cond[k], uncond[k]], axis=0) for k in cond}

    def guided(mod, params, x, t, cond, uncond, cfg_on, scale, cstate, compute_now, rescale):
        if not use_cfg:
            return call(mod, params, x, t, cond, cstate, compute_now)
        if batched_cfg:
            both, cstate, info = call(
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
            first, second = cstate if cache.enabled else (None, None)
            prediction, first, info_c = call(mod, params, x, t, cond, first, compute_now)
            negative, second, info_u = call(mod, params, x, t, uncond, second, compute_now)
            cstate = (first, second) if cache.enabled else cstate
            info = None if info_c is None else jnp.concatenate([info_c, info_u])
        # diffusers applies CFG only when the (first) scale is > 1; keep that per sample.
        mixed = jnp.where(cfg_on, negative + scale * (prediction - negative), prediction)
        if rescale is not None:
            on, factor = rescale
            mixed = jnp.where(on, rescale_guidance(mixed, prediction, factor), mixed)
        return mixed, cstate, info

    def fresh_state(params, x, t, cond, uncond):
        """A cache state sized by the streams the denoiser's block stack carries."""

        def probe(streams, run_blocks, num_blocks):
            return run_blocks(streams, 0, num_blocks), streams

        def shapes(rows_x, rows_t, conditioning):
            return jax.eval_shape(
                lambda: family.apply(module, params, rows_x, rows_t, conditioning, run_stack=probe)
            )[1]

        if use_cfg and batched_cfg:
            two = shapes(jnp.concatenate([x, x]), jnp.concatenate([t, t]), stacked(cond, uncond))
            return step_cache.init_state(cache, two)
        one = step_cache.init_state(cache, shapes(x, t, cond))
        return (one, one) if use_cfg else one

    def denoise(
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
        batch = latents.shape[0]
        per_sample = (batch,) + (1,) * (latents.ndim - 1)
        scale = cfg_scale_b.reshape(per_sample)
        cfg_on = cfg_on_b.reshape(per_sample)
        rescale = None
        if rescale_b is not None:  # (where it applies, the factor), per sample
            factor = rescale_b.reshape(per_sample).astype(jnp.float32)
            rescale = (cfg_on & (factor > 0), factor)
        schedule = cstate = ratios = None
        if cache.enabled:
            schedule, cstate = cache_in["schedule"], cache_in["state"]
            if cstate is None:
                t0 = jnp.broadcast_to(state.timesteps[0].astype(jnp.float32), (batch,))
                cstate = fresh_state(params, latents, t0, cond, uncond)
            if cache.kind == "calibrate":
                rows = batch * (2 if use_cfg else 1)
                ratios = jnp.zeros((state.timesteps.shape[0], rows), jnp.float32)

        def body(i, carry):
            x, st, cs, rs = carry
            t_now = st.timesteps[i].astype(jnp.float32)
            t = jnp.broadcast_to(t_now, (batch,))
            compute_now = None if schedule is None else schedule[i]
            x_in = schedulers.scale_model_input(st, x)  # x itself for all but Euler
            if second is None:
                prediction, cs, info = guided(
                    module, params, x_in, t, cond, uncond, cfg_on, scale, cs, compute_now, rescale
                )
            else:
                params_2, boundary, cfg_scale_2_b = second
                scale_2 = cfg_scale_2_b.reshape(per_sample)
                prediction, cs, info = jax.lax.cond(
                    t_now >= boundary,
                    lambda: guided(
                        module, params, x_in, t, cond, uncond, cfg_on, scale, cs, None, rescale
                    ),
                    lambda: guided(
                        second_module,
                        params_2,
                        x_in,
                        t,
                        cond,
                        uncond,
                        cfg_on,
                        scale_2,
                        cs,
                        None,
                        rescale,
                    ),
                )
            if rs is not None:
                rs = rs.at[i].set(info)
            x, st = step_fn(st, prediction, x)
            return x, st, cs, rs

        x, state, cstate, ratios = jax.lax.fori_loop(
            start, stop, body, (latents, state, cstate, ratios)
        )
        return x, state, ({"state": cstate, "ratios": ratios} if cache.enabled else None)

    return jax.jit(denoise)
