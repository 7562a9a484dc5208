"""The rectified-flow objective Wan trains with, bound to the train config.

The math lives in :mod:`jaxcore.flow_matching` (pure, tested against diffusers); this module
only maps ``ObjectiveSection`` onto it, so train and evaluate score samples identically.
MaxDiffusion's ``sigma = (1 - t) sigma_min + t`` (a little noise left at t = 0) is kept.
"""

from __future__ import annotations

import jax

from jaxcore import flow_matching as fm
from stages.train.config import ObjectiveSection

SIGMA_MIN = fm.MAXDIFFUSION_SIGMA_MIN
NUM_TRAIN_TIMESTEPS = 1000.0


def sample_t(key: jax.Array, batch: int, cfg: ObjectiveSection) -> jax.Array:
    """Training times t in [0, 1), one per sample, by ``cfg.timestep_sampling``."""
    return fm.sample_timesteps(
        key,
        batch,
        cfg.timestep_sampling,
        shift=cfg.timestep_shift,
        logit_mean=cfg.logit_mean,
        logit_std=cfg.logit_std,
    )


def noisy_input(x0: jax.Array, noise: jax.Array, t: jax.Array) -> jax.Array:
    """``x_t`` at times ``t`` (MaxDiffusion's sigma_min variant)."""
    return fm.add_noise(x0, noise, t, sigma_min=SIGMA_MIN).astype(x0.dtype)


velocity_target = fm.velocity_target


def loss_weight(t: jax.Array, cfg: ObjectiveSection) -> jax.Array:
    """Per-sample weight, a fixed function of t normalised over the schedule (never the batch).

    The config gives the bell in timestep units (centre, width); ``flow_matching`` takes it in
    t units as ``exp(-sharpness (t - centre)^2)``.
    """
    width = cfg.weighting_width / NUM_TRAIN_TIMESTEPS
    return fm.loss_weights(
        t,
        cfg.loss_weighting,
        center=cfg.weighting_center / NUM_TRAIN_TIMESTEPS,
        sharpness=0.5 / width**2,
    )


def per_sample_loss(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over every axis but the batch, in float32."""
    return fm.flow_matching_loss(prediction, target)[1]
