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

Initial noise is drawn per prompt from its seed alone (:func:`initial_latents`), never from a
batch-level key, so outputs do not depend on batch composition, batch size or device count.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


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


@functools.lru_cache(maxsize=32)
def denoise_fn(family, module, step_fn, use_cfg: bool, second_module=None):
    """jit(params, latents, cond, uncond, cfg_on[B], cfg_scale[B], state, start, stop, second)
    -> (latents, state) after the steps ``start <= i < stop``.

    ``cond``/``uncond`` are dicts of conditioning tensors (``uncond`` is ignored without CFG);
    ``cfg_on`` says per sample whether CFG applies at all (diffusers: the first expert's scale
    is > 1), ``cfg_scale`` is the scale applied; ``state`` is a scheduler state whose
    ``timesteps`` the loop walks. ``second`` is ``None`` for one denoiser, else
    ``(params_2, boundary, cfg_scale_2[B])`` for ``second_module``.
    """

    def predict(mod, params, x, t, conditioning):
        return family.apply(mod, params, x, t, conditioning).astype(jnp.float32)

    def guided(mod, params, x, t, cond, uncond, cfg_on, scale):
        prediction = predict(mod, params, x, t, cond)
        if not use_cfg:
            return prediction
        negative = predict(mod, params, x, t, uncond)
        # diffusers applies CFG only when the (first) scale is > 1; keep that per sample.
        return jnp.where(cfg_on, negative + scale * (prediction - negative), prediction)

    def denoise(params, latents, cond, uncond, cfg_on_b, cfg_scale_b, state, start, stop, second):
        batch = latents.shape[0]
        per_sample = (batch,) + (1,) * (latents.ndim - 1)
        scale = cfg_scale_b.reshape(per_sample)
        cfg_on = cfg_on_b.reshape(per_sample)

        def body(i, carry):
            x, st = carry
            t_now = st.timesteps[i].astype(jnp.float32)
            t = jnp.broadcast_to(t_now, (batch,))
            if second is None:
                prediction = guided(module, params, x, t, cond, uncond, cfg_on, scale)
            else:
                params_2, boundary, cfg_scale_2_b = second
                scale_2 = cfg_scale_2_b.reshape(per_sample)
                prediction = jax.lax.cond(
                    t_now >= boundary,
                    lambda: guided(module, params, x, t, cond, uncond, cfg_on, scale),
                    lambda: guided(second_module, params_2, x, t, cond, uncond, cfg_on, scale_2),
                )
            return step_fn(st, prediction, x)

        return jax.lax.fori_loop(start, stop, body, (latents, state))

    return jax.jit(denoise)
