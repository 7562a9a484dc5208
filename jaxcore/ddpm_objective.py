"""DDPM training math for epsilon- and v-prediction denoisers (the UNet families): pure, jittable.

The forward process is the discrete DDPM one, ``x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps``
with integer ``t`` in ``[0, T)`` (Ho et al., arXiv 2006.11239); the model regresses either the
noise ``eps`` or the velocity ``v = sqrt(abar_t) eps - sqrt(1 - abar_t) x0`` (Salimans & Ho,
arXiv 2202.00512). The noise schedule (``abar``) is :mod:`jaxcore.schedulers.classic`'s, which
reproduces diffusers' ``DDPMScheduler`` (including zero-terminal-SNR rescaling).

What diffusers' ``examples/text_to_image/train_text_to_image.py`` and
``train_text_to_image_sdxl.py`` do per batch, written as small functions here:

* timesteps uniform integers in ``[0, T)`` (:func:`sample_timesteps`);
* offset noise, ``eps += noise_offset * N(0, 1)`` drawn once per sample and channel
  (:func:`offset_noise`; Guttenberg, "Diffusion with offset noise", CrossLabs 2023);
* input perturbation: the *model input* is noised with ``eps + gamma * N(0, 1)`` while the
  target keeps ``eps`` (:func:`perturb_noise`; Ning et al., arXiv 2301.11706);
* the target by prediction type (:func:`target`);
* min-SNR-gamma loss weights (:func:`min_snr_weights`; Hang et al., arXiv 2303.09556), with the
  SNR computed as diffusers' ``training_utils.compute_snr`` (:func:`snr`).

Every function takes the schedule as a :class:`classic.NoiseScheduleConfig` (a frozen, hashable
dataclass), so a jitted loss closes over it as a static value.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxcore.schedulers import classic

KINDS = ("epsilon", "v_prediction")

NoiseScheduleConfig = classic.NoiseScheduleConfig
add_noise = classic.add_noise  # the noisy model input (diffusers DDPMScheduler.add_noise)


def check_kind(kind: str) -> None:
    """Raise ValueError unless ``kind`` is a prediction type trained here (names it)."""
    if kind not in KINDS:
        raise ValueError(f"prediction type {kind!r} is not trained here; expected one of {KINDS}")


def sample_timesteps(key: jax.Array, batch: int, num_train_timesteps: int) -> jax.Array:
    """``[batch]`` int32 training timesteps, uniform over ``0 .. T - 1`` (the scripts'
    ``torch.randint(0, T, (B,))``)."""
    return jax.random.randint(key, (batch,), 0, num_train_timesteps, dtype=jnp.int32)


def eval_timesteps(timesteps: jax.Array, num_train_timesteps: int) -> jax.Array:
    """The integer DDPM timestep of each eval record's fixed timestep (0..1000 scale): rounded
    to the nearest integer and clamped to ``[0, T - 1]`` (so 1000 scores at ``T - 1 = 999``,
    the noisiest training step; the records' scale is not rescaled when ``T != 1000``)."""
    rounded = jnp.round(jnp.asarray(timesteps, jnp.float32))
    return jnp.clip(rounded, 0, num_train_timesteps - 1).astype(jnp.int32)


def offset_noise(key: jax.Array, noise: jax.Array, noise_offset: float) -> jax.Array:
    """``noise + noise_offset * N(0, 1)`` of shape ``[B, C, 1, ...]``: one offset per sample and
    channel, constant over the spatial axes, so the model learns to change an image's mean
    brightness (which plain i.i.d. noise almost never perturbs)."""
    if noise.ndim < 2:
        raise ValueError(f"noise must be [B, C, ...], got shape {noise.shape}")
    shape = noise.shape[:2] + (1,) * (noise.ndim - 2)
    return noise + noise_offset * jax.random.normal(key, shape, noise.dtype)


def perturb_noise(key: jax.Array, noise: jax.Array, input_perturbation: float) -> jax.Array:
    """The noise that builds the *model input* under input perturbation, ``noise + gamma *
    N(0, 1)`` (same shape); the regression target keeps the unperturbed ``noise``. The extra
    noise simulates the prediction errors the sampler feeds back (exposure bias)."""
    return noise + input_perturbation * jax.random.normal(key, noise.shape, noise.dtype)


def target(
    kind: str, schedule: NoiseScheduleConfig, clean: jax.Array, noise: jax.Array, timesteps
) -> jax.Array:
    """The regression target: ``noise`` (epsilon) or the velocity (v_prediction, diffusers
    ``DDPMScheduler.get_velocity``)."""
    check_kind(kind)
    if kind == "epsilon":
        return noise
    return classic.velocity(schedule, clean, noise, timesteps)


@functools.lru_cache(maxsize=64)
def _snr_table(schedule: NoiseScheduleConfig) -> np.ndarray:
    # float32 in diffusers' order, (sqrt(abar) / sqrt(1 - abar))^2 rather than the exact
    # abar / (1 - abar), so the weights match compute_snr to the bit (IEEE sqrt and division
    # are correctly rounded in numpy and PyTorch alike).
    abar = classic.alphas_cumprod(schedule)
    ratio = np.sqrt(abar) / np.sqrt(np.float32(1.0) - abar)
    table = ratio * ratio
    table.flags.writeable = False
    return table


def snr_table(schedule: NoiseScheduleConfig) -> np.ndarray:
    """``[T]`` float32 signal-to-noise ratios ``abar_t / (1 - abar_t)``, one per timestep (0 at
    the last one under zero-terminal-SNR rescaling)."""
    return _snr_table(schedule).copy()


def snr(schedule: NoiseScheduleConfig, timesteps: jax.Array) -> jax.Array:
    """``[B]`` float32 SNR at integer ``timesteps`` (diffusers ``training_utils.compute_snr``)."""
    return jnp.asarray(_snr_table(schedule))[jnp.asarray(timesteps)]


def min_snr_weights(snr_values: jax.Array, gamma: float, kind: str) -> jax.Array:
    """Per-sample min-SNR-gamma loss weights (Hang et al. 2023), as diffusers' scripts apply them.

    The paper's weight on the x0-MSE is ``min(snr, gamma)``; on the epsilon-MSE (which is the
    x0-MSE times ``snr``) it is ``min(snr, gamma) / snr``, and on the v-MSE (``snr + 1`` times)
    ``min(snr, gamma) / (snr + 1)``. At zero SNR (the last step under zero-terminal-SNR
    rescaling) diffusers divides 0 by 0; epsilon takes the limit, 1, instead of NaN.
    """
    check_kind(kind)
    if not gamma > 0:
        raise ValueError(f"snr_gamma must be > 0, got {gamma}")
    snr_values = jnp.asarray(snr_values, jnp.float32)
    clipped = jnp.minimum(snr_values, jnp.float32(gamma))
    if kind == "v_prediction":
        return clipped / (snr_values + 1)
    positive = snr_values > 0
    return jnp.where(positive, clipped / jnp.where(positive, snr_values, 1.0), 1.0)


__all__ = [
    "KINDS",
    "NoiseScheduleConfig",
    "add_noise",
    "check_kind",
    "eval_timesteps",
    "min_snr_weights",
    "offset_noise",
    "perturb_noise",
    "sample_timesteps",
    "snr",
    "snr_table",
    "target",
]
