"""The sampling loop, shared by every family: a scheduler and guidance around any denoiser.

At each scheduler timestep the family's denoiser predicts (:meth:`Family.apply`); with
classifier-free guidance a second pass on the negative conditioning gives
``uncond + scale * (cond - uncond)`` (diffusers' formula for Wan's ``guidance_scale`` and
Flux's ``true_cfg_scale``), applied per sample only where its scale is > 1; the scheduler steps
the latents. The whole loop is ONE jitted function (``lax.fori_loop`` with the scheduler state
in the carry), compiled once per (family, denoiser module, scheduler, CFG on/off, shapes).

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


@functools.lru_cache(maxsize=32)
def denoise_fn(family, module, step_fn, use_cfg: bool):
    """jit(params, latents, cond, uncond, cfg_scale[B], state) -> final latents.

    ``cond``/``uncond`` are dicts of conditioning tensors (``uncond`` is ignored without CFG);
    ``state`` is a scheduler state whose ``timesteps`` the loop walks.
    """

    def predict(params, x, t, conditioning):
        return family.apply(module, params, x, t, conditioning).astype(jnp.float32)

    def denoise(params, latents, cond, uncond, cfg_scale_b, state):
        batch = latents.shape[0]
        scale = cfg_scale_b.reshape((batch,) + (1,) * (latents.ndim - 1))

        def body(i, carry):
            x, st = carry
            t = jnp.broadcast_to(st.timesteps[i].astype(jnp.float32), (batch,))
            prediction = predict(params, x, t, cond)
            if use_cfg:
                negative = predict(params, x, t, uncond)
                # diffusers applies CFG only when the scale is > 1; keep that per sample.
                guided = negative + scale * (prediction - negative)
                prediction = jnp.where(scale > 1.0, guided, prediction)
            return step_fn(st, prediction, x)

        x, _ = jax.lax.fori_loop(0, state.timesteps.shape[0], body, (latents, state))
        return x

    return jax.jit(denoise)
