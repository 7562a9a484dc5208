"""Flow-matching Euler sampler: a pure, jittable twin of diffusers' Euler flow scheduler.

Reference: diffusers ``FlowMatchEulerDiscreteScheduler`` (scheduling_flow_match_euler_discrete.py)
with its defaults (static ``shift``, no dynamic shifting, no Karras/exponential/beta sigmas, no
stochastic sampling). The ODE is the rectified-flow one (Liu et al., arXiv 2209.03003;
Esser et al., arXiv 2403.03206): ``x_sigma = (1 - sigma) x0 + sigma noise`` and the model
predicts the velocity ``v = noise - x0``, so one Euler step is
``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v``.

The schedule is computed once on the host in numpy with the same float32/float64 roundings as
diffusers, so timesteps and sigmas match it bit for bit; stepping is pure JAX.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class FlowEulerState:
    """Sampler state (a pytree, so a whole sampling loop can be jitted).

    Attributes:
      sigmas: ``[N + 1]`` float32 noise levels, decreasing, the last one 0.
      timesteps: ``[N]`` float32 model timesteps, ``sigma * num_train_timesteps``.
      step_index: int32 scalar, the step the next call to :func:`flow_euler_step` takes when it
        is not given one explicitly.
    """

    sigmas: jax.Array
    timesteps: jax.Array
    step_index: jax.Array

    @property
    def num_inference_steps(self) -> int:
        """Number of model evaluations in the schedule (static: read from the array shape)."""
        return self.timesteps.shape[0]


def shift_sigmas(sigmas, shift: float):
    """The static timestep shift ``s * sigma / (1 + (s - 1) * sigma)`` (SD3 eq. 23, Wan).

    Works on numpy or JAX arrays and keeps their dtype; ``shift = 1`` is the identity.
    """
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flow_euler_sigmas(
    num_inference_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side schedule ``(sigmas[N + 1], timesteps[N])`` exactly as diffusers computes it.

    diffusers first builds a shifted *training* grid in float32 (``sigma_max``, ``sigma_min`` are
    its ends), spaces the inference timesteps linearly between those ends in float64, and then
    applies the shift a second time. The double shift is what the reference does, so it is what
    we reproduce; ``sigma_max`` is always 1.
    """
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    train_timesteps = np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)
    train_sigmas = shift_sigmas(train_timesteps[::-1] / np.float32(num_train_timesteps), shift)
    sigma_max, sigma_min = float(train_sigmas[0]), float(train_sigmas[-1])

    timesteps64 = np.linspace(
        sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_inference_steps
    )
    sigmas = shift_sigmas(timesteps64 / num_train_timesteps, shift).astype(np.float32)
    timesteps = sigmas * np.float32(num_train_timesteps)
    return np.concatenate([sigmas, np.zeros(1, np.float32)]), timesteps


def make_flow_euler(
    num_inference_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000
) -> FlowEulerState:
    """Builds the Euler sampler state for ``num_inference_steps`` steps with a static ``shift``."""
    sigmas, timesteps = flow_euler_sigmas(num_inference_steps, shift, num_train_timesteps)
    return FlowEulerState(
        sigmas=jnp.asarray(sigmas),
        timesteps=jnp.asarray(timesteps),
        step_index=jnp.zeros((), jnp.int32),
    )


def timesteps(state: FlowEulerState) -> jax.Array:
    """The ``[N]`` timesteps to feed the model, one per step (float32, in [0, 1000])."""
    return state.timesteps


def flow_euler_step(
    state: FlowEulerState,
    model_output: jax.Array,
    sample: jax.Array,
    step_index: jax.Array | int | None = None,
) -> tuple[jax.Array, FlowEulerState]:
    """One Euler step ``x + (sigma_{i+1} - sigma_i) * v``; returns ``(prev_sample, new_state)``.

    Args:
      state: from :func:`make_flow_euler`.
      model_output: predicted velocity ``v`` (same shape as ``sample``).
      sample: current ``x_i``.
      step_index: which step this is (may be traced). ``None`` uses ``state.step_index``.

    The update is computed in float32 (as diffusers upcasts the sample) and cast back to the
    dtype of ``model_output``. The returned state's ``step_index`` is ``step_index + 1``.
    """
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output shape {model_output.shape} != sample shape {sample.shape}")
    index = state.step_index if step_index is None else jnp.asarray(step_index, jnp.int32)
    sigma = state.sigmas[index]
    sigma_next = state.sigmas[index + 1]
    prev_sample = sample.astype(jnp.float32) + (sigma_next - sigma) * model_output.astype(
        jnp.float32
    )
    return prev_sample.astype(model_output.dtype), state.replace(step_index=index + 1)
