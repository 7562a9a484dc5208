"""PLMS sampler: a pure, jittable twin of diffusers' ``PNDMScheduler`` with ``skip_prk_steps``.

Reference: diffusers ``PNDMScheduler`` (scheduling_pndm.py, ``set_timesteps``, ``step_plms``,
``_get_prev_sample``); Liu et al., "Pseudo Numerical Methods for Diffusion Models on
Manifolds", arXiv 2202.09778, eq. 9 (the transfer ``x_t -> x_t'``) and eq. 12 (the linear
multistep combination); the ``skip_prk_steps`` variant is crowsonkb's PLMS sampler as Stable
Diffusion 1.x / 2-base ship it (their ``scheduler_config.json`` is a ``PNDMScheduler`` with
``skip_prk_steps: true``).

Schedule: with ``N`` inference steps the spaced timesteps ``t_0 > ... > t_{N-1}`` are walked
as ``t_0, t_1, t_1, t_2, ..., t_{N-1}``, ``N + 1`` model evaluations. Step ``k`` with model
output ``e_k``:

- ``k = 0``: ``x <- transfer(x, t_0 -> t_0 - T//N, e_0)``, remembering the starting sample;
- ``k = 1``: a Heun-like redo of the first step from the remembered sample with
  ``(e_0 + e_1) / 2``, from ``t_1 + T//N`` to ``t_1`` (``e_1`` is not kept in the history);
- ``k >= 2``: Adams-Bashforth of order ``min(k, 4)`` over the history ``[e_0, e_2, ...]``
  (``(3 e - e') / 2``, ``(23 e - 16 e' + 5 e'') / 12``, ``(55 e - 59 e' + 37 e'' - 9 e''') / 24``),
  then the transfer from ``t_k`` to ``t_k - T//N``.

The transfer (eq. 9): ``x' = sqrt(a'/a) x - (a' - a) e / (a sqrt(1 - a') + sqrt(a (1 - a) a'))``
with ``a = alpha_bar_t`` and ``a' = alpha_bar_{t'}`` (``a'`` of a negative ``t'`` is 1 with
``set_alpha_to_one``, else ``alpha_bar_0``). ``v_prediction`` outputs are converted after the
multistep combination, ``e = sqrt(a) v + sqrt(1 - a) x``, as diffusers does.

Not supported: ``skip_prk_steps=False`` (the Runge-Kutta warm-up of the original PNDM, which no
released text-to-image pipeline uses) is refused; ``prediction_type="sample"`` is refused (as
diffusers raises for it). The model input needs no scaling and the initial noise is standard
normal. diffusers' ``PNDMScheduler`` has no zero-terminal-SNR option, so a config's
``rescale_betas_zero_snr`` is ignored here as ``from_config`` ignores it.
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

HISTORY = 4  # model outputs the fourth-order multistep formula reads


@dataclasses.dataclass(frozen=True)
class PNDMConfig(NoiseScheduleConfig):
    """``PNDMScheduler``'s configuration (diffusers names and defaults).

    Beyond :class:`~jaxcore.schedulers.classic.NoiseScheduleConfig`:
      skip_prk_steps: must be true (PLMS only; see the module docstring).
      set_alpha_to_one: ``alpha_bar`` before the first training step is 1 (else ``alpha_bar_0``).
    """

    timestep_spacing: str = "leading"
    skip_prk_steps: bool = False
    set_alpha_to_one: bool = False

    _prediction_types = ("epsilon", "v_prediction")

    def _validate(self) -> None:
        if not self.skip_prk_steps:
            raise ClassicConfigError(
                "skip_prk_steps=False (PNDM's Runge-Kutta warm-up steps) is not supported; "
                "only the PLMS variant (skip_prk_steps=true, what Stable Diffusion ships) is"
            )


@struct.dataclass
class PNDMState:
    """Sampler state (a pytree; ``prediction_type`` is static).

    Attributes:
      timesteps: ``[N + 1]`` int32 model timesteps (the second one repeats).
      step_index: int32 scalar, the step the next :func:`pndm_step` takes.
      sample_scale: ``sqrt(a'/a)``; output_scale: ``(a' - a) / (a sqrt(1 - a') + sqrt(a (1 - a)
        a'))``; v_signal, v_noise: ``sqrt(a)``, ``sqrt(1 - a)`` (v-prediction), all ``[N + 1]``.
      history: ``[4, *sample_shape]`` float32 model outputs, newest last (zeros until filled).
      first_sample: the sample the first step started from (the second step restarts there).
      prediction_type: ``epsilon`` or ``v_prediction``.
    """

    timesteps: jax.Array
    step_index: jax.Array
    sample_scale: jax.Array
    output_scale: jax.Array
    v_signal: jax.Array
    v_noise: jax.Array
    history: jax.Array | None
    first_sample: jax.Array | None
    prediction_type: str = struct.field(pytree_node=False, default="epsilon")

    @property
    def num_inference_steps(self) -> int:
        """Number of model evaluations (N + 1; static: read from the array shape)."""
        return self.timesteps.shape[0]


def pndm_timesteps(config: PNDMConfig, num_inference_steps: int) -> np.ndarray:
    """The ``[N + 1]`` int64 timesteps of ``PNDMScheduler.set_timesteps`` (skip_prk_steps)."""
    if num_inference_steps < 2:
        # diffusers indexes the second-to-last spaced timestep, which one step does not have
        raise ValueError(f"PLMS needs num_inference_steps >= 2, got {num_inference_steps}")
    spaced = classic.spaced_timesteps(config, num_inference_steps, round_linspace=True)
    spaced = spaced.astype(np.int64)
    return np.concatenate([spaced[:1], spaced[1:2], spaced[1:]])


def _transfer_coefficients(config: PNDMConfig, current: np.ndarray, previous: np.ndarray):
    """``(sample_scale, output_scale, sqrt(a), sqrt(1 - a))`` of eq. 9 per step, float32."""
    alpha_bar = classic.alphas_cumprod(config)
    if current.max() >= len(alpha_bar):
        raise ValueError(
            f"timestep {int(current.max())} is beyond num_train_timesteps="
            f"{config.num_train_timesteps} (diffusers fails on it too)"
        )
    a = alpha_bar[current]
    a_prev = classic.previous_alpha_bar(alpha_bar, previous, config.set_alpha_to_one)
    beta, beta_prev = f32(1.0) - a, f32(1.0) - a_prev
    denominator = a * np.sqrt(beta_prev) + np.sqrt(a * beta * a_prev)
    return np.sqrt(a_prev / a), (a_prev - a) / denominator, np.sqrt(a), np.sqrt(beta)


def make_pndm(
    num_inference_steps: int,
    config: PNDMConfig | Mapping[str, Any] | None = None,
    *,
    sample_shape: Sequence[int] | None = None,
) -> PNDMState:
    """Builds the PLMS state; step it with :func:`pndm_step`.

    Args:
      num_inference_steps: ``N`` (>= 2); the loop makes ``N + 1`` model evaluations.
      config: a :class:`PNDMConfig`, a diffusers ``scheduler_config.json`` dict (read as
        ``PNDMScheduler.from_config`` would), or ``None`` for diffusers' defaults (which refuse:
        they have ``skip_prk_steps=False``).
      sample_shape: latent shape; given, the history is allocated now so the state has fixed
        shapes for ``lax.fori_loop`` (otherwise the first step allocates it).
    """
    config = classic.as_config(PNDMConfig, config)
    if config.rescale_betas_zero_snr:  # not a PNDMScheduler option: from_config drops it
        config = dataclasses.replace(config, rescale_betas_zero_snr=False)
    timesteps = pndm_timesteps(config, num_inference_steps)
    ratio = config.num_train_timesteps // num_inference_steps
    # the second evaluation redoes the first step: from t_1 + ratio to t_1
    current = timesteps.copy()
    current[1] = timesteps[1] + ratio
    previous = timesteps - ratio
    previous[1] = timesteps[1]
    sample_scale, output_scale, v_signal, v_noise = _transfer_coefficients(
        config, current, previous
    )
    state = PNDMState(
        timesteps=jnp.asarray(timesteps, jnp.int32),
        step_index=jnp.zeros((), jnp.int32),
        sample_scale=jnp.asarray(sample_scale),
        output_scale=jnp.asarray(output_scale),
        v_signal=jnp.asarray(v_signal),
        v_noise=jnp.asarray(v_noise),
        history=None,
        first_sample=None,
        prediction_type=config.prediction_type,
    )
    if sample_shape is not None:
        state = _with_history(state, tuple(sample_shape))
    return state


def _with_history(state: PNDMState, sample_shape: tuple[int, ...]) -> PNDMState:
    history = jnp.zeros((HISTORY, *sample_shape), jnp.float32)
    return state.replace(history=history, first_sample=jnp.zeros(sample_shape, jnp.float32))


def _multistep_output(index, output, history):
    """The combined model output at step ``index`` (diffusers' ``step_plms`` arithmetic);
    ``history`` already holds ``output`` last for every step but the second."""
    e1, e2, e3, e4 = history[-1], history[-2], history[-3], history[-4]
    branches = (
        lambda: output,
        lambda: (output + e1) / 2,
        lambda: (3 * e1 - e2) / 2,
        lambda: (23 * e1 - 16 * e2 + 5 * e3) / 12,
        lambda: (1 / 24) * (55 * e1 - 59 * e2 + 37 * e3 - 9 * e4),
    )
    # branch 0 and 1: the first two steps; from step 2 the order is min(step, 4)
    return jax.lax.switch(jnp.minimum(index, HISTORY), branches)


def pndm_step(
    state: PNDMState, model_output: jax.Array, sample: jax.Array
) -> tuple[jax.Array, PNDMState]:
    """One PLMS step at ``state.step_index``; returns ``(prev_sample, new_state)``.

    ``model_output`` is the model's prediction at ``sample`` and
    ``state.timesteps[state.step_index]``. Computed in float32; the result has ``sample``'s dtype.
    """
    output, x = classic.float32_step_inputs(model_output, sample)
    if state.history is None:
        state = _with_history(state, sample.shape)
    index = state.step_index
    # every output but the second joins the history (diffusers keeps the last four)
    pushed = jnp.concatenate([state.history[1:], output[None]], axis=0)
    history = jnp.where(index == 1, state.history, pushed)
    first_sample = jnp.where(index == 0, x, state.first_sample)
    start = jnp.where(index == 1, state.first_sample, x)
    combined = _multistep_output(index, output, history)
    if state.prediction_type == "v_prediction":
        combined = state.v_signal[index] * combined + state.v_noise[index] * start
    prev = state.sample_scale[index] * start - state.output_scale[index] * combined
    new_state = state.replace(history=history, first_sample=first_sample, step_index=index + 1)
    return prev.astype(sample.dtype), new_state


# PLMS feeds the model the sample unscaled, and its latents start as standard normal.
scale_model_input = classic.unscaled_model_input
init_noise_sigma = classic.unit_noise_sigma


__all__ = [
    "PNDMConfig",
    "PNDMState",
    "init_noise_sigma",
    "make_pndm",
    "pndm_step",
    "pndm_timesteps",
    "scale_model_input",
]
