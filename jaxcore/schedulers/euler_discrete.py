"""Euler and Euler-ancestral samplers: pure, jittable twins of diffusers' discrete Euler schedulers.

References: diffusers ``EulerDiscreteScheduler`` (scheduling_euler_discrete.py) and
``EulerAncestralDiscreteScheduler`` (scheduling_euler_ancestral_discrete.py); Karras et al.,
arXiv 2206.00364, Algorithm 2 without churn (Euler) and k-diffusion's ``sample_euler_ancestral``.

Both integrate the probability-flow ODE in the noise-to-signal ratio ``sigma = sqrt((1 - abar) /
abar)`` with the latents scaled to ``x = x_ddpm * sqrt(1 + sigma^2)``. Hence the model sees
:func:`scale_model_input` ``x / sqrt(sigma^2 + 1)``, and the initial latents are standard noise
times :func:`init_noise_sigma`. From the data prediction ``x0`` one step is::

    Euler:      x' = x + (x - x0) / sigma * (sigma_next - sigma)
    ancestral:  x' = x + (x - x0) / sigma * (sigma_down - sigma) + sigma_up * z,
                sigma_up = sqrt(sigma_next^2 (sigma^2 - sigma_next^2) / sigma^2),
                sigma_down = sqrt(sigma_next^2 - sigma_up^2),

with fresh standard noise ``z`` per step, taken from the state (:func:`make_euler_ancestral`).

Parity: timesteps and sigmas equal diffusers' to 1e-6 relative (bit for bit but for ulps of
PyTorch's float32 sqrt); over whole loops (1-61 steps, every spacing, epsilon/v/sample
prediction, zero-SNR, Karras/exponential/beta sigmas, log-linear interpolation, final sigma_min,
continuous timesteps, the ancestral sampler fed diffusers' noise) every intermediate sample
matches diffusers' float32 to 1e-7 of the largest sample magnitude so far
(tests/jaxcore/test_classic_schedulers.py).

Not supported: diffusers' per-call ``step(s_churn=...)`` (stochastic churn, off by default) and
custom ``timesteps``/``sigmas`` in ``set_timesteps``. Two diffusers quirks are reproduced:
``log_linear`` interpolation spaces ``N + 1`` sigmas and still appends the final one (so the last
step ends at the smallest training sigma, not 0), and ancestral ``sample`` prediction is refused
as diffusers raises for it. One is not: diffusers starts at the *second* occurrence of the first
timestep when it occurs twice in the schedule (never with the default spacings); we always start
at step 0.
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
from jaxcore.schedulers.classic import NoiseScheduleConfig, f32

INTERPOLATION_TYPES = ("linear", "log_linear")
TIMESTEP_TYPES = ("discrete", "continuous")
FINAL_SIGMAS_TYPES = ("zero", "sigma_min")


@dataclasses.dataclass(frozen=True)
class EulerConfig(NoiseScheduleConfig):
    """``EulerDiscreteScheduler``'s configuration (diffusers names and defaults).

    Beyond :class:`~jaxcore.schedulers.classic.NoiseScheduleConfig`:
      interpolation_type: sigmas at the timesteps by ``linear`` interpolation of the training
        sigmas, or ``log_linear`` (evenly in ``log sigma``, see the module docstring).
      use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas: respace the sigmas between
        ``sigma_max`` and ``sigma_min`` (default: the schedule's ends); the timesteps follow.
      timestep_type: ``continuous`` feeds the model ``0.25 log sigma`` (with v-prediction only).
      final_sigmas_type: the last step goes to ``zero`` or to the smallest training sigma.
    """

    interpolation_type: str = "linear"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    timestep_type: str = "discrete"
    final_sigmas_type: str = "zero"

    # diffusers also accepts "original_sample" for "sample".
    _prediction_types = (*classic.PREDICTION_TYPES, "original_sample")

    def _validate(self) -> None:
        classic.check_choice("interpolation_type", self.interpolation_type, INTERPOLATION_TYPES)
        classic.check_choice("timestep_type", self.timestep_type, TIMESTEP_TYPES)
        classic.check_choice("final_sigmas_type", self.final_sigmas_type, FINAL_SIGMAS_TYPES)
        classic.check_one_sigma_spacing(self)


@dataclasses.dataclass(frozen=True)
class EulerAncestralConfig(NoiseScheduleConfig):
    """``EulerAncestralDiscreteScheduler``'s configuration: the noise schedule alone (see
    :class:`~jaxcore.schedulers.classic.NoiseScheduleConfig`); ``sample`` prediction is refused
    (diffusers does not implement it)."""

    _prediction_types = ("epsilon", "v_prediction")


@struct.dataclass
class EulerState:
    """Sampler state of both Euler samplers (a pytree; ``prediction_type`` is static).

    Per-step ``[N]`` float32 scalars are precomputed on the host exactly as diffusers' float32
    arithmetic computes them, so a step only combines tensors.

    Attributes:
      sigmas: ``[N + 1]`` float32 sigmas, decreasing (``N + 2`` with ``log_linear``, see the
        module docstring); the last is 0 or the smallest training sigma.
      timesteps: ``[N]`` float32 model timesteps (fractional with ``linspace`` spacing or
        respaced sigmas).
      step_index: int32 scalar, the step the next :func:`euler_step` takes.
      input_scale: ``sqrt(sigma^2 + 1)``, the divisor of :func:`scale_model_input`.
      dt: ``sigma_next - sigma`` (Euler) or ``sigma_down - sigma`` (ancestral).
      noise_scale: ``sigma_up`` (ancestral), else 0.
      v_output_scale, v_sample_divisor: ``-sigma / sqrt(sigma^2 + 1)`` and ``sigma^2 + 1``, the
        v-prediction's ``x0 = v_output_scale v + x / v_sample_divisor``.
      initial_sigma: the standard deviation of the initial latents (:func:`init_noise_sigma`).
      step_noise: ``[N, *sample_shape]`` float32 noise of each ancestral step, else ``None``.
      prediction_type: ``epsilon``, ``v_prediction`` or ``sample``.
    """

    sigmas: jax.Array
    timesteps: jax.Array
    step_index: jax.Array
    input_scale: jax.Array
    dt: jax.Array
    noise_scale: jax.Array
    v_output_scale: jax.Array
    v_sample_divisor: jax.Array
    initial_sigma: jax.Array
    step_noise: jax.Array | None
    prediction_type: str = struct.field(pytree_node=False, default="epsilon")

    @property
    def num_inference_steps(self) -> int:
        """Number of model evaluations in the schedule (static: read from the array shape)."""
        return self.timesteps.shape[0]


# ---------------------------------------------------------------- host-side schedule


def _sigmas_at(config: EulerConfig, timesteps: np.ndarray, table: np.ndarray, num_steps: int):
    """The float64 sigmas of the spaced timesteps: interpolated in the training table, or
    (``log_linear``) ``num_steps + 1`` sigmas evenly in ``log sigma`` over the whole table."""
    if config.interpolation_type == "linear":
        return np.interp(timesteps, np.arange(len(table)), table)
    # torch.linspace of numpy's float32 logs, then a float32 exp (diffusers' exact recipe).
    logs = classic.torch_linspace(np.log(table[-1]), np.log(table[0]), num_steps + 1)
    return classic.exp32(logs).astype(np.float64)


def euler_schedule(
    config: EulerConfig | EulerAncestralConfig, num_inference_steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side ``(sigmas float32, timesteps float32)`` of diffusers'
    ``Euler[Ancestral]DiscreteScheduler(**config).set_timesteps(N)``, bit for bit."""
    alpha_bar = classic.alphas_cumprod(config, zero_snr_floor=True)
    table = classic.train_sigmas(alpha_bar)
    spaced = classic.spaced_timesteps(config, num_inference_steps, round_linspace=False)
    if isinstance(config, EulerAncestralConfig):
        sigmas = np.interp(spaced, np.arange(len(table)), table)
        return np.concatenate([sigmas, [0.0]]).astype(f32), spaced.astype(f32)

    sigmas = _sigmas_at(config, spaced, table, num_inference_steps)
    timesteps = spaced
    kind = classic.sigma_spacing(config)
    if kind is not None:
        # The respaced range defaults to this schedule's ends (not the training table's).
        sigma_max = sigmas[0].item() if config.sigma_max is None else config.sigma_max
        sigma_min = sigmas[-1].item() if config.sigma_min is None else config.sigma_min
        sigmas = classic.respaced_sigmas(kind, sigma_max, sigma_min, num_inference_steps)
        timesteps = classic.sigma_to_timestep(sigmas, np.log(table))
    last = table[0] if config.final_sigmas_type == "sigma_min" else 0.0
    sigmas = np.concatenate([sigmas, [last]]).astype(f32)
    if config.timestep_type == "continuous" and config.prediction_type == "v_prediction":
        timesteps = f32(0.25) * classic.log32(sigmas[:-1])
    return sigmas, timesteps.astype(f32)


def _initial_sigma(sigmas: np.ndarray, timestep_spacing: str) -> np.float32:
    """diffusers' ``init_noise_sigma``: the largest sigma, or ``sqrt(max^2 + 1)`` with
    ``leading`` spacing."""
    largest = sigmas.max()
    if timestep_spacing in ("linspace", "trailing"):
        return largest
    return np.sqrt(largest * largest + f32(1.0))


def _state(
    sigmas: np.ndarray,
    timesteps: np.ndarray,
    config: NoiseScheduleConfig,
    dt: np.ndarray,
    noise_scale: np.ndarray,
    step_noise: jax.Array | None,
) -> EulerState:
    sigma = sigmas[: len(timesteps)]
    sigma_squared_plus_one = sigma * sigma + f32(1.0)
    input_scale = np.sqrt(sigma_squared_plus_one)
    prediction = "sample" if config.prediction_type == "original_sample" else config.prediction_type
    return EulerState(
        sigmas=jnp.asarray(sigmas),
        timesteps=jnp.asarray(timesteps),
        step_index=jnp.zeros((), jnp.int32),
        input_scale=jnp.asarray(input_scale),
        dt=jnp.asarray(dt),
        noise_scale=jnp.asarray(noise_scale),
        v_output_scale=jnp.asarray(-sigma / input_scale),
        v_sample_divisor=jnp.asarray(sigma_squared_plus_one),
        initial_sigma=jnp.asarray(_initial_sigma(sigmas, config.timestep_spacing)),
        step_noise=step_noise,
        prediction_type=prediction,
    )


def make_euler(
    num_inference_steps: int,
    config: EulerConfig | Mapping[str, Any] | None = None,
    *,
    sample_shape: Sequence[int] | None = None,
) -> EulerState:
    """Builds the Euler state; step it with :func:`euler_step`.

    Args:
      num_inference_steps: number of model evaluations.
      config: an :class:`EulerConfig`, a diffusers ``scheduler_config.json`` dict (read as
        ``EulerDiscreteScheduler.from_config`` would; SDXL's), or ``None`` for the defaults.
      sample_shape: unused (Euler keeps no history); accepted for a uniform interface.
    """
    del sample_shape
    config = classic.as_config(EulerConfig, config)
    sigmas, timesteps = euler_schedule(config, num_inference_steps)
    steps = len(timesteps)
    dt = sigmas[1 : steps + 1] - sigmas[:steps]
    return _state(sigmas, timesteps, config, dt, np.zeros(steps, f32), None)


def ancestral_sigmas(sigma: np.ndarray, sigma_next: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(sigma_up, sigma_down)`` of the ancestral step ``sigma -> sigma_next`` (float32): the
    deterministic step goes to ``sigma_down`` and fresh noise of ``sigma_up`` brings the variance
    back to ``sigma_next^2``."""
    next_squared = sigma_next * sigma_next
    sigma_up = np.sqrt(next_squared * (sigma * sigma - next_squared) / (sigma * sigma))
    return sigma_up, np.sqrt(next_squared - sigma_up * sigma_up)


def make_euler_ancestral(
    num_inference_steps: int,
    config: EulerAncestralConfig | Mapping[str, Any] | None = None,
    *,
    noise: Any = None,
    seeds: Sequence[int] | None = None,
    sample_shape: Sequence[int] | None = None,
) -> EulerState:
    """Builds the Euler-ancestral state; step it with :func:`euler_step`.

    Args:
      num_inference_steps: number of model evaluations ``N``.
      config: an :class:`EulerAncestralConfig`, a diffusers ``scheduler_config.json`` dict (read
        as ``EulerAncestralDiscreteScheduler.from_config`` would), or ``None``.
      noise: the ``[N, *sample_shape]`` standard-normal noise of each step (what diffusers draws
        with ``randn_tensor`` inside ``step``), or
      seeds: one seed per batch element: the noise is drawn on the host with
        :func:`~jaxcore.schedulers.classic.step_noise` (deterministic per prompt).
      sample_shape: the latents' shape; needed with ``seeds``, checked against ``noise``.
    """
    config = classic.as_config(EulerAncestralConfig, config)
    sigmas, timesteps = euler_schedule(config, num_inference_steps)
    steps = len(timesteps)
    sigma, sigma_next = sigmas[:steps], sigmas[1 : steps + 1]
    sigma_up, sigma_down = ancestral_sigmas(sigma, sigma_next)
    step_noise = classic.checked_noise(noise, seeds, steps, sample_shape)
    return _state(sigmas, timesteps, config, sigma_down - sigma, sigma_up, step_noise)


# ---------------------------------------------------------------- stepping


def _data_prediction(state: EulerState, index, model_output, sample):
    """``x0`` from the model output at ``sample`` (the scaled latents), as diffusers forms it."""
    if state.prediction_type == "epsilon":
        return sample - state.sigmas[index] * model_output
    if state.prediction_type == "v_prediction":
        return model_output * state.v_output_scale[index] + sample / state.v_sample_divisor[index]
    return model_output


def euler_step(
    state: EulerState, model_output: jax.Array, sample: jax.Array
) -> tuple[jax.Array, EulerState]:
    """One Euler (or Euler-ancestral) step at ``state.step_index``; returns
    ``(prev_sample, new_state)``.

    ``model_output`` is the model's prediction for ``scale_model_input(state, sample)`` at
    ``state.timesteps[state.step_index]``; ``sample`` is the unscaled latents. Computed in
    float32; the result has ``sample``'s dtype.
    """
    output, x = classic.float32_step_inputs(model_output, sample)
    index = state.step_index
    x0 = _data_prediction(state, index, output, x)
    derivative = (x - x0) / state.sigmas[index]
    prev = x + derivative * state.dt[index]
    if state.step_noise is not None:
        prev = prev + state.step_noise[index] * state.noise_scale[index]
    return prev.astype(sample.dtype), state.replace(step_index=index + 1)


# The ancestral sampler differs only in its state (dt, noise_scale, step_noise).
euler_ancestral_step = euler_step


def scale_model_input(state: EulerState, sample: jax.Array) -> jax.Array:
    """The model input at the current step, ``sample / sqrt(sigma^2 + 1)`` (unit variance)."""
    return (sample / state.input_scale[state.step_index]).astype(sample.dtype)


def init_noise_sigma(state: EulerState) -> jax.Array:
    """Standard deviation of the initial latents (multiply standard-normal noise by it)."""
    return state.initial_sigma


__all__ = [
    "EulerAncestralConfig",
    "EulerConfig",
    "EulerState",
    "ancestral_sigmas",
    "euler_ancestral_step",
    "euler_schedule",
    "euler_step",
    "init_noise_sigma",
    "make_euler",
    "make_euler_ancestral",
    "scale_model_input",
]
