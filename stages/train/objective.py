"""The rectified-flow objective Wan trains with, as pure jittable functions.

Reference: MaxDiffusion ``trainers/wan_trainer.py`` and SD3 (arXiv 2403.03206, section 3):
``x_t = (1 - sigma) x0 + sigma * noise``, target velocity ``noise - x0``, the model gets the
timestep ``1000 * t``. MaxDiffusion's ``sigma = (1 - t) sigma_min + t`` with a tiny sigma_min is
kept (it avoids an exactly clean input at t=0).

Loss weights are normalised over the *schedule* (t in [0, 1000]), never over the batch: see
/work/shared/notes/references.md for the MaxDiffusion defect this avoids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from stages.train.config import ObjectiveSection

SIGMA_MIN = 0.003 / 1.002
NUM_TRAIN_TIMESTEPS = 1000.0


def sample_t(key: jax.Array, batch: int, cfg: ObjectiveSection) -> jax.Array:
    """Training times t in [0, 1), one per sample, by ``cfg.timestep_sampling``."""
    if cfg.timestep_sampling == "logit_normal":
        return jax.nn.sigmoid(cfg.logit_mean + cfg.logit_std * jax.random.normal(key, (batch,)))
    u = jax.random.uniform(key, (batch,))
    if cfg.timestep_sampling == "shifted":
        s = cfg.timestep_shift
        return s * u / (1.0 + (s - 1.0) * u)
    return u


def sigma_of_t(t: jax.Array) -> jax.Array:
    """Noise level of time t (MaxDiffusion: ``(1 - t) * sigma_min + t``)."""
    return (1.0 - t) * SIGMA_MIN + t


def noisy_input(x0: jax.Array, noise: jax.Array, sigma: jax.Array) -> jax.Array:
    """``x_t = (1 - sigma) x0 + sigma * noise``, sigma broadcast over all but the batch axis."""
    s = sigma.reshape((-1,) + (1,) * (x0.ndim - 1)).astype(x0.dtype)
    return (1.0 - s) * x0 + s * noise


def velocity_target(x0: jax.Array, noise: jax.Array) -> jax.Array:
    return noise - x0


def loss_weight(timestep: jax.Array, cfg: ObjectiveSection) -> jax.Array:
    """Per-sample weight; the gaussian bell is normalised to mean 1 over t in [0, 1000]."""
    if cfg.loss_weighting == "none":
        return jnp.ones_like(timestep, jnp.float32)
    grid = jnp.linspace(0.0, NUM_TRAIN_TIMESTEPS, 1001)

    def bell(t):
        return jnp.exp(-0.5 * ((t - cfg.weighting_center) / cfg.weighting_width) ** 2)

    return bell(timestep.astype(jnp.float32)) / jnp.mean(bell(grid))


def per_sample_mse(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over every axis but the batch, in float32."""
    err = jnp.square(prediction.astype(jnp.float32) - target.astype(jnp.float32))
    return jnp.mean(err.reshape(err.shape[0], -1), axis=1)
