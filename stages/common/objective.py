"""The training objective, shared by train (the loss) and evaluate / periodic eval (scoring).

The math lives in :mod:`jaxcore.flow_matching` (pure, tested against diffusers); this module
binds :class:`ObjectiveSection` onto it and applies it to any family's denoiser through
:meth:`jaxcore.families.Family.apply`, so train and evaluate score samples identically.
MaxDiffusion's ``sigma = (1 - t) sigma_min + t`` (a little noise left at t = 0) is kept.

Families declare their target (:attr:`Family.objective`): every family so far is
``flow_matching``; epsilon / v-prediction (the UNet families) plug in here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp

from jaxcore import flow_matching as fm
from stages.common import records
from stages.common.errors import StageInputError

SIGMA_MIN = fm.MAXDIFFUSION_SIGMA_MIN
NUM_TRAIN_TIMESTEPS = 1000.0
OBJECTIVES = ("flow_matching",)


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    """Flow-matching objective (Wan / SD3): timestep sampling and optional loss weighting.

    ``timestep_sampling``: "uniform" t~U[0,1); "logit_normal" t=sigmoid(N(logit_mean,
    logit_std)); "shifted" (MaxDiffusion's Wan trainer) t~U then t'=s*t/(1+(s-1)t) with
    s=``timestep_shift``. ``loss_weighting``: "none" or "gaussian" (a bell around
    ``weighting_center`` in timestep units, normalised over the schedule, not the batch).
    """

    timestep_sampling: Literal["uniform", "logit_normal", "shifted"] = "shifted"
    timestep_shift: float = 3.0
    logit_mean: float = 0.0
    logit_std: float = 1.0
    loss_weighting: Literal["none", "gaussian"] = "none"
    weighting_center: float = 500.0
    weighting_width: float = 250.0
    # The embedded-guidance input of families whose denoiser takes one (Flux dev), as
    # diffusers' Flux training scripts set it; families without one ignore it.
    guidance_scale: float = 3.5
    # Train only on t in [lo, hi) (the distribution above, truncated). Set by model.expert
    # for one expert of a two-expert model.
    timestep_range: tuple[float, float] = (0.0, 1.0)

    def __post_init__(self):
        if self.timestep_shift <= 0:
            raise ValueError(f"timestep_shift must be > 0, got {self.timestep_shift}")
        if self.logit_std <= 0 or self.weighting_width <= 0:
            raise ValueError("logit_std and weighting_width must be > 0")
        object.__setattr__(self, "timestep_range", tuple(float(v) for v in self.timestep_range))
        lo, hi = self.timestep_range
        if len(self.timestep_range) != 2 or not 0.0 <= lo < hi <= 1.0:
            raise ValueError(
                f"timestep_range must be [lo, hi] with 0 <= lo < hi <= 1, got {self.timestep_range}"
            )


def check_objective(family) -> None:
    """Refuse a family whose training target is not implemented here (names both)."""
    if family.objective not in OBJECTIVES:
        raise StageInputError(
            f"the {family.name} family trains with {family.objective!r}; implemented: {OBJECTIVES}"
        )


def sample_t(key: jax.Array, batch: int, cfg: ObjectiveSection) -> jax.Array:
    """Training times t in [0, 1), one per sample, by ``cfg.timestep_sampling``."""
    return fm.sample_timesteps(
        key,
        batch,
        cfg.timestep_sampling,
        shift=cfg.timestep_shift,
        logit_mean=cfg.logit_mean,
        logit_std=cfg.logit_std,
        t_range=cfg.timestep_range,
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


def embedded_inputs(family, denoiser_config, cfg: ObjectiveSection) -> dict[str, float]:
    """The per-sample scalar inputs the family's denoiser takes besides the records (Flux dev:
    ``guidance``), at the values training uses; recorded in the train manifest so evaluate
    scores with the same ones."""
    configs = {family.denoiser_component: denoiser_config}
    return dict(
        family.guidance(configs, guidance_scale=cfg.guidance_scale, true_cfg_scale=1.0).embedded
    )


def split_batch(
    batch: Mapping[str, jax.Array], embedded: Mapping[str, float] | None = None
) -> tuple[jax.Array, dict]:
    """(latents as float32, the conditioning tensors) of a batch of records, with the embedded
    inputs as ``[B]`` arrays."""
    latents = batch[records.LATENTS].astype(jnp.float32)
    conditioning = {k: v for k, v in batch.items() if k != records.LATENTS}
    for name, value in (embedded or {}).items():
        conditioning[name] = jnp.full((latents.shape[0],), value, jnp.float32)
    return latents, conditioning


def loss_at(family, module, params, latents, conditioning, t, noise) -> jax.Array:
    """Per-sample flow-matching MSE of ``latents`` at times ``t`` [B] with ``noise``."""
    x_t = noisy_input(latents, noise, t)
    prediction = family.apply(module, params, x_t, t * NUM_TRAIN_TIMESTEPS, conditioning)
    return per_sample_loss(prediction, velocity_target(latents, noise))


def training_loss(
    family, module, params, batch, key, cfg: ObjectiveSection, embedded=None
) -> jax.Array:
    """Mean weighted loss of one batch, with timesteps and noise drawn from ``key``."""
    latents, conditioning = split_batch(batch, embedded)
    key_t, key_noise = jax.random.split(key)
    t = sample_t(key_t, latents.shape[0], cfg)
    noise = jax.random.normal(key_noise, latents.shape, jnp.float32)
    per_sample = loss_at(family, module, params, latents, conditioning, t, noise)
    return jnp.mean(per_sample * loss_weight(t, cfg))
