"""DDIM sampler: a pure, jittable twin of diffusers' ``DDIMScheduler``.

Reference: diffusers ``DDIMScheduler`` (scheduling_ddim.py); DDIM, Song et al., arXiv
2010.02502, eq. 12. From the model output at ``x_t`` it forms the data and noise predictions
``(x0, eps)`` and moves to the previous timestep ``t' = t - T // N``::

    x_t' = sqrt(abar_t') x0 + sqrt(1 - abar_t' - s_t^2) eps + s_t z,
    s_t = eta * sqrt((1 - abar_t') / (1 - abar_t) * (1 - abar_t / abar_t'))

(``abar`` of a negative ``t'`` is 1 with ``set_alpha_to_one``, else ``abar_0``). Like diffusers,
``t'`` is ``t - T // N`` whatever the spacing, so with ``trailing``/``linspace`` it need not be the
next timestep of the schedule.

Parity: timesteps equal diffusers'; ``abar`` bit for bit (to an ulp with zero-SNR rescaling);
over whole loops (1-61 steps, every spacing, epsilon/v/sample prediction, zero-SNR, clipping,
eta > 0 with the same noise) every intermediate sample matches diffusers' float32 to 8.4e-7 of
the largest sample magnitude so far (tests/jaxcore/test_classic_schedulers.py).

Supported: every ``DDIMScheduler`` option except ``thresholding`` (dynamic thresholding, a
pixel-space method) which is refused; ``eta > 0`` takes its noise from the state (see
:func:`make_ddim`). The model input needs no scaling (:func:`scale_model_input` is the identity)
and the initial noise is standard normal (:func:`init_noise_sigma` is 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxcore.schedulers import classic
from jaxcore.schedulers.classic import ClassicConfigError, NoiseScheduleConfig, f32


@dataclasses.dataclass(frozen=True)
class DDIMConfig(NoiseScheduleConfig):
    """``DDIMScheduler``'s configuration (diffusers names and defaults).

    Beyond :class:`~jaxcore.schedulers.classic.NoiseScheduleConfig`:
      clip_sample, clip_sample_range: clamp the predicted ``x0`` to ``[-range, range]``.
      set_alpha_to_one: ``abar`` before the first training step is 1 (else ``abar_0``).
      thresholding: must stay false (refused); dynamic_thresholding_ratio and sample_max_value
        are its parameters, accepted and unused.
    """

    timestep_spacing: str = "leading"
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0

    def _validate(self) -> None:
        if self.thresholding:
            raise ClassicConfigError(
                "thresholding=True is not supported (dynamic thresholding of x0, Imagen's "
                "pixel-space method); use clip_sample instead or keep it false"
            )


@struct.dataclass
class DDIMState:
    """Sampler state (a pytree; the last three fields are static configuration).

    Per-step ``[N]`` float32 scalars are precomputed on the host exactly as diffusers' float32
    arithmetic computes them, so a step only combines tensors.

    Attributes:
      timesteps: ``[N]`` int32 model timesteps, decreasing.
      step_index: int32 scalar, the step the next :func:`ddim_step` takes.
      sqrt_alpha_bar: ``sqrt(abar_t)``; sqrt_one_minus_alpha_bar: ``sqrt(1 - abar_t)``.
      sqrt_alpha_bar_prev: ``sqrt(abar_t')``; direction_scale: ``sqrt(1 - abar_t' - s_t^2)``.
      noise_scale: ``s_t`` (0 when ``eta = 0``).
      step_noise: ``[N, *sample_shape]`` float32 noise ``z`` of each step, or ``None`` (eta = 0).
      prediction_type: ``epsilon``, ``v_prediction`` or ``sample``.
      clip_range: clamp ``x0`` to ``[-clip_range, clip_range]``; ``None`` for no clipping.
      use_clipped_model_output: recompute ``eps`` from the clipped ``x0`` (diffusers' step flag).
    """

    timesteps: jax.Array
    step_index: jax.Array
    sqrt_alpha_bar: jax.Array
    sqrt_one_minus_alpha_bar: jax.Array
    sqrt_alpha_bar_prev: jax.Array
    direction_scale: jax.Array
    noise_scale: jax.Array
    step_noise: jax.Array | None
    prediction_type: str = struct.field(pytree_node=False, default="epsilon")
    clip_range: float | None = struct.field(pytree_node=False, default=None)
    use_clipped_model_output: bool = struct.field(pytree_node=False, default=False)

    @property
    def num_inference_steps(self) -> int:
        """Number of model evaluations in the schedule (static: read from the array shape)."""
        return self.timesteps.shape[0]


def ddim_timesteps(config: DDIMConfig, num_inference_steps: int) -> np.ndarray:
    """The ``[N]`` int64 timesteps of ``DDIMScheduler.set_timesteps``."""
    if num_inference_steps > config.num_train_timesteps:
        raise ValueError(
            f"num_inference_steps={num_inference_steps} > num_train_timesteps="
            f"{config.num_train_timesteps} (diffusers refuses it too)"
        )
    spaced = classic.spaced_timesteps(config, num_inference_steps, round_linspace=True)
    return spaced.astype(np.int64)


def ddim_coefficients(
    config: DDIMConfig, num_inference_steps: int, timesteps: np.ndarray, eta: float = 0.0
) -> dict[str, np.ndarray]:
    """The per-step float32 scalars of :class:`DDIMState`, in diffusers' float32 arithmetic.

    Timesteps index ``abar`` as diffusers' tensors do (a timestep of -1, which trailing spacing
    can produce, reads the last entry).
    """
    alpha_bar = classic.alphas_cumprod(config)
    prev_timesteps = timesteps - config.num_train_timesteps // num_inference_steps
    alpha_t = alpha_bar[timesteps]
    alpha_prev = classic.previous_alpha_bar(alpha_bar, prev_timesteps, config.set_alpha_to_one)
    beta_t, beta_prev = f32(1.0) - alpha_t, f32(1.0) - alpha_prev
    with np.errstate(divide="ignore", invalid="ignore"):
        variance = (beta_prev / beta_t) * (f32(1.0) - alpha_t / alpha_prev)
        noise_scale = f32(eta) * np.sqrt(variance)
        direction = np.sqrt(f32(1.0) - alpha_prev - noise_scale * noise_scale)
    return dict(
        sqrt_alpha_bar=np.sqrt(alpha_t),
        sqrt_one_minus_alpha_bar=np.sqrt(beta_t),
        sqrt_alpha_bar_prev=np.sqrt(alpha_prev),
        direction_scale=direction,
        noise_scale=noise_scale,
    )


def make_ddim(
    num_inference_steps: int,
    config: DDIMConfig | Mapping[str, Any] | None = None,
    *,
    eta: float = 0.0,
    use_clipped_model_output: bool = False,
    noise: Any = None,
    seeds: Sequence[int] | None = None,
    sample_shape: Sequence[int] | None = None,
) -> DDIMState:
    """Builds the DDIM state for ``num_inference_steps`` steps; step it with :func:`ddim_step`.

    Args:
      num_inference_steps: number of model evaluations (<= ``num_train_timesteps``).
      config: a :class:`DDIMConfig`, a diffusers ``scheduler_config.json`` dict (read as
        ``DDIMScheduler.from_config`` would), or ``None`` for diffusers' defaults.
      eta: the stochasticity of diffusers' ``step(eta=)`` (0: deterministic DDIM, 1: DDPM-like).
      use_clipped_model_output: diffusers' ``step(use_clipped_model_output=)``.
      noise: with ``eta > 0``, the ``[N, *sample_shape]`` noise of each step (diffusers'
        ``variance_noise``), or
      seeds: with ``eta > 0``, one seed per batch element to draw it with
        :func:`~jaxcore.schedulers.classic.step_noise` (needs ``sample_shape``).
      sample_shape: the latents' shape (only used to draw or check the noise).
    """
    config = classic.as_config(DDIMConfig, config)
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    timesteps = ddim_timesteps(config, num_inference_steps)
    coefficients = ddim_coefficients(config, num_inference_steps, timesteps, eta)
    step_noise = None
    if eta > 0:
        step_noise = classic.checked_noise(noise, seeds, len(timesteps), sample_shape)
    elif noise is not None or seeds is not None:
        raise ValueError("noise/seeds are only used with eta > 0")
    return DDIMState(
        timesteps=jnp.asarray(timesteps, jnp.int32),
        step_index=jnp.zeros((), jnp.int32),
        **{name: jnp.asarray(value) for name, value in coefficients.items()},
        step_noise=step_noise,
        prediction_type=config.prediction_type,
        clip_range=config.clip_sample_range if config.clip_sample else None,
        use_clipped_model_output=use_clipped_model_output,
    )


def _predictions(state: DDIMState, index, model_output, sample):
    """``(x0, eps)`` from the model output at ``sample``, as diffusers forms them."""
    signal, noise = state.sqrt_alpha_bar[index], state.sqrt_one_minus_alpha_bar[index]
    if state.prediction_type == "epsilon":
        return (sample - noise * model_output) / signal, model_output
    if state.prediction_type == "v_prediction":
        return signal * sample - noise * model_output, signal * model_output + noise * sample
    return model_output, (sample - signal * model_output) / noise


def ddim_step(
    state: DDIMState, model_output: jax.Array, sample: jax.Array
) -> tuple[jax.Array, DDIMState]:
    """One DDIM step at ``state.step_index``; returns ``(prev_sample, new_state)``.

    ``model_output`` is the model's prediction at ``sample`` and
    ``state.timesteps[state.step_index]``. Computed in float32; the result has ``sample``'s dtype.
    """
    output, x = classic.float32_step_inputs(model_output, sample)
    index = state.step_index
    x0, eps = _predictions(state, index, output, x)
    if state.clip_range is not None:
        x0 = jnp.clip(x0, -state.clip_range, state.clip_range)
    if state.use_clipped_model_output:
        eps = (x - state.sqrt_alpha_bar[index] * x0) / state.sqrt_one_minus_alpha_bar[index]
    prev = state.sqrt_alpha_bar_prev[index] * x0 + state.direction_scale[index] * eps
    if state.step_noise is not None:
        prev = prev + state.noise_scale[index] * state.step_noise[index]
    return prev.astype(sample.dtype), state.replace(step_index=index + 1)


# DDIM feeds the model the sample unscaled, and its latents start as standard normal.
scale_model_input = classic.unscaled_model_input
init_noise_sigma = classic.unit_noise_sigma


__all__ = [
    "DDIMConfig",
    "DDIMState",
    "ddim_step",
    "ddim_timesteps",
    "init_noise_sigma",
    "make_ddim",
    "scale_model_input",
]
