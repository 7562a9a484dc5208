"""Flow-matching Euler sampler: a pure, jittable twin of diffusers' Euler flow scheduler.

Reference: diffusers ``FlowMatchEulerDiscreteScheduler`` (scheduling_flow_match_euler_discrete.py)
as SD3, Wan and Flux use it. The ODE is the rectified-flow one (Liu et al., arXiv 2209.03003;
Esser et al., arXiv 2403.03206): ``x_sigma = (1 - sigma) x0 + sigma noise`` and the model
predicts the velocity ``v = noise - x0``, so one Euler step is
``x_{i+1} = x_i + (sigma_{i+1} - sigma_i) v``.

The schedule is computed once on the host in numpy with the same float32/float64 roundings as
diffusers, so timesteps and sigmas match it bit for bit; stepping is pure JAX.

Two ways to build a schedule:

* :func:`make_flow_euler` ``(steps, shift)``: the scheduler's defaults with a static shift.
* :func:`make_flow_euler_from_options` ``(options, steps, sigmas=, mu=)``: any configuration read
  from a ``scheduler_config.json`` by :func:`flow_euler_options`, i.e. what ``set_timesteps``
  does with custom ``sigmas`` and a resolution-dependent ``mu``. Flux (FluxPipeline) reads::

      options = flow_euler_options(json.load(f), "scheduler/scheduler_config.json")
      state = make_flow_euler_from_options(
          options, steps, sigmas=pipeline_sigmas(steps), mu=shift_mu(options, image_seq_len)
      )

  and feeds the transformer ``timesteps(state)[i] / 1000``.

Supported beyond the defaults: dynamic shifting (``time_shift_type`` exponential, the Flux/SD3
``exp(mu) / (exp(mu) + 1/t - 1)``, or linear ``mu / (mu + 1/t - 1)``), ``shift_terminal``
(LTX-Video's stretch), Karras (Karras et al., arXiv 2206.00364), exponential and beta (Lee et al.,
arXiv 2407.12173) sigmas, and ``invert_sigmas`` (Mochi). Refused: ``stochastic_sampling`` (it
draws fresh torch noise inside every step), custom ``timesteps``, per-token timesteps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxcore.schedulers import classic


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


# ---------------------------------------------------------------- configuration

FLOW_EULER_CLASS_NAME = "FlowMatchEulerDiscreteScheduler"
TIME_SHIFT_TYPES = ("exponential", "linear")


class FlowEulerConfigError(ValueError):
    """A scheduler configuration we refuse: malformed, unknown, or not reproduced exactly."""


@dataclasses.dataclass(frozen=True)
class FlowEulerOptions:
    """``FlowMatchEulerDiscreteScheduler``'s configuration (diffusers names and defaults).

    Read one from a ``scheduler_config.json`` with :func:`flow_euler_options`. Fields:
      num_train_timesteps: ``T``; model timesteps are ``sigma * T``.
      shift: static shift, used when ``use_dynamic_shifting`` is false.
      use_dynamic_shifting: shift by ``mu`` given per call (Flux: from the image size) instead.
      base_shift, max_shift, base_image_seq_len, max_image_seq_len: the line
        ``mu(image_seq_len)`` of :func:`shift_mu` (read by the pipeline, not by the scheduler).
      invert_sigmas: use ``1 - sigma`` (Mochi); the schedule then ends at 1.
      shift_terminal: stretch the shifted schedule so its last sigma is this (LTX-Video).
      use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas: respace between the first and
        last shifted sigma (at most one).
      time_shift_type: dynamic shift ``"exponential"`` (Flux, SD3) or ``"linear"``.
      stochastic_sampling: must stay false (refused, see the module docstring).
    """

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float | None = 0.5
    max_shift: float | None = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    invert_sigmas: bool = False
    shift_terminal: float | None = None
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    time_shift_type: str = "exponential"
    stochastic_sampling: bool = False

    def __post_init__(self):
        classic.normalise_fields(self, FlowEulerConfigError, null_flags_are_false=False)
        if self.num_train_timesteps < 1:
            raise FlowEulerConfigError(
                f"num_train_timesteps must be >= 1, got {self.num_train_timesteps}"
            )
        if self.shift <= 0:
            raise FlowEulerConfigError(f"shift must be > 0, got {self.shift}")
        if self.time_shift_type not in TIME_SHIFT_TYPES:
            raise FlowEulerConfigError(
                f"time_shift_type={self.time_shift_type!r}: expected one of {TIME_SHIFT_TYPES}"
            )
        if self.shift_terminal and not 0 < self.shift_terminal < 1:
            # diffusers divides by (1 - shift_terminal) and flips the schedule beyond 1.
            raise FlowEulerConfigError(
                f"shift_terminal={self.shift_terminal!r}: must be in (0, 1) (or null for none)"
            )
        classic.check_one_sigma_spacing(self, FlowEulerConfigError)
        if self.stochastic_sampling:
            raise FlowEulerConfigError(
                "stochastic_sampling=True is not supported: diffusers then re-noises every step "
                "with fresh torch noise ((1 - sigma_next) x0 + sigma_next noise), which this "
                "deterministic sampler does not reproduce"
            )


def flow_euler_options(config: Mapping[str, Any], where: str) -> FlowEulerOptions:
    """Reads a ``FlowMatchEulerDiscreteScheduler`` ``scheduler_config.json`` dict.

    Keys starting with ``_`` are bookkeeping and ignored, except that ``_class_name``, when
    present, must name this scheduler. Any other key we do not know, a wrong type, or a value we
    do not reproduce raises :class:`FlowEulerConfigError` naming the key and ``where`` (the file).
    """
    class_name = config.get("_class_name", FLOW_EULER_CLASS_NAME)
    if class_name != FLOW_EULER_CLASS_NAME:
        raise FlowEulerConfigError(
            f"{where}: _class_name={class_name!r} is not {FLOW_EULER_CLASS_NAME!r}"
        )
    known = {field.name for field in dataclasses.fields(FlowEulerOptions)}
    kwargs = {key: value for key, value in config.items() if not key.startswith("_")}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise FlowEulerConfigError(
            f"{where}: unknown {FLOW_EULER_CLASS_NAME} keys {unknown}; known keys: {sorted(known)}"
        )
    try:
        return FlowEulerOptions(**kwargs)
    except FlowEulerConfigError as error:
        raise FlowEulerConfigError(f"{where}: {error}") from None


# ---------------------------------------------------------------- Flux's sigmas and mu


def calculate_shift(
    image_seq_len: float,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FluxPipeline's ``mu``: linear in the packed image sequence length (``(H/16) * (W/16)``),
    ``base_shift`` at ``base_seq_len`` and ``max_shift`` at ``max_seq_len`` (extrapolated
    beyond). Same float64 operations in the same order, so the same value bit for bit."""
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len and base_seq_len are both {base_seq_len}; no line")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


def shift_mu(options: FlowEulerOptions, image_seq_len: int) -> float:
    """:func:`calculate_shift` with the scheduler config's line, as the dynamic-shifting
    pipelines call it (FluxPipeline, LTXPipeline: ``mu`` from the image's token count)."""
    for name in ("base_shift", "max_shift"):
        if getattr(options, name) is None:
            raise ValueError(f"{name} is null in the scheduler config; mu cannot be computed")
    return calculate_shift(
        image_seq_len,
        options.base_image_seq_len,
        options.max_image_seq_len,
        options.base_shift,
        options.max_shift,
    )


def pipeline_sigmas(num_inference_steps: int) -> np.ndarray:
    """The unshifted sigmas the flow pipelines pass (FluxPipeline, LTXPipeline):
    ``linspace(1, 1/N, N)`` in float64."""
    _check_num_steps(num_inference_steps)
    return np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)


# ---------------------------------------------------------------- host-side schedule


def time_shift(sigmas: np.ndarray, mu: float, time_shift_type: str = "exponential"):
    """Resolution-dependent shift of diffusers' ``time_shift(mu, 1.0, t)``.

    ``exponential``: ``e^mu / (e^mu + 1/t - 1)`` (SD3 eq. 23 with ``s = e^mu``; Flux);
    ``linear``: ``mu / (mu + 1/t - 1)``. Computed in the dtype of ``sigmas`` (the python-float
    ``e^mu`` is rounded to it), as diffusers does.
    """
    scale = math.exp(mu) if time_shift_type == "exponential" else mu
    return scale / (scale + (1 / sigmas - 1))


def stretch_to_terminal(sigmas: np.ndarray, shift_terminal: float) -> np.ndarray:
    """Scale ``1 - sigma`` so the last sigma becomes ``shift_terminal`` (LTX-Video's rf.py).

    A schedule whose last sigma is 1 (e.g. one step from sigma 1) cannot be stretched: diffusers
    divides 0 by 0 there and returns NaN sigmas; we raise instead.
    """
    one_minus = 1 - sigmas
    if one_minus[-1] == 0:
        raise ValueError(
            "shift_terminal cannot stretch a schedule whose last sigma is 1, e.g. a single step "
            "from sigma 1 (diffusers returns NaN sigmas)"
        )
    scale = one_minus[-1] / (1 - shift_terminal)
    return 1 - one_minus / scale


def _check_num_steps(num_inference_steps: int) -> None:
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")


def _train_sigma_range(options: FlowEulerOptions) -> tuple[float, float]:
    """``(sigma_max, sigma_min)``: the ends of the scheduler's float32 training grid
    ``linspace(1, T, T) / T``, shifted by ``shift`` unless dynamic shifting is on."""
    train_steps = options.num_train_timesteps
    grid = np.linspace(1, train_steps, train_steps, dtype=np.float32)[::-1]
    grid = grid / np.float32(train_steps)
    if not options.use_dynamic_shifting:
        grid = shift_sigmas(grid, options.shift)
    return float(grid[0]), float(grid[-1])


def flow_euler_schedule(
    options: FlowEulerOptions,
    num_inference_steps: int | None = None,
    *,
    sigmas: Sequence[float] | np.ndarray | None = None,
    mu: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side ``(sigmas[N + 1] float32, timesteps[N] float32)`` of diffusers'
    ``FlowMatchEulerDiscreteScheduler(**options).set_timesteps(N, sigmas=sigmas, mu=mu)``.

    Bit-identical to it (the tests compare with ``array_equal``): the base sigmas are either
    ``linspace`` between the training grid's ends in float64, or the given ``sigmas`` rounded to
    float32 (and then shifted *in float32*, as diffusers does); then the static or dynamic
    shift, ``shift_terminal``, Karras/exponential/beta respacing, one rounding to float32,
    ``timesteps = sigma * T``, and the final sigma 0 (1 with ``invert_sigmas``).

    Args:
      options: from :func:`flow_euler_options`.
      num_inference_steps: number of model evaluations; may be omitted when ``sigmas`` is given.
      sigmas: custom unshifted sigmas (Flux: :func:`pipeline_sigmas`), ``N`` of them.
      mu: dynamic shift; required when ``options.use_dynamic_shifting`` (Flux: :func:`shift_mu`)
        and ignored otherwise, as in diffusers (FluxPipeline always passes one).
    """
    if options.use_dynamic_shifting and mu is None:
        raise ValueError(
            "mu must be passed when use_dynamic_shifting is true (the pipeline's "
            "mu = shift_mu(options, image_seq_len))"
        )
    if sigmas is None:
        if num_inference_steps is None:
            raise ValueError("give num_inference_steps or sigmas")
        _check_num_steps(num_inference_steps)
        sigma_max, sigma_min = _train_sigma_range(options)
        train_steps = options.num_train_timesteps
        base = np.linspace(sigma_max * train_steps, sigma_min * train_steps, num_inference_steps)
        base = base / train_steps
    else:
        base = np.asarray(sigmas).astype(np.float32)
        if base.ndim != 1 or base.size == 0:
            raise ValueError(f"sigmas must be a non-empty 1-D sequence, got shape {base.shape}")
        if num_inference_steps is not None and num_inference_steps != base.size:
            raise ValueError(
                f"{base.size} sigmas given for num_inference_steps={num_inference_steps}"
            )
        num_inference_steps = base.size

    if options.use_dynamic_shifting:
        shifted = time_shift(base, float(mu), options.time_shift_type)
    else:
        shifted = shift_sigmas(base, options.shift)
    if options.shift_terminal:
        shifted = stretch_to_terminal(shifted, options.shift_terminal)
    spacing = classic.sigma_spacing(options)
    if spacing is not None:  # respaced between the shifted schedule's own ends
        first, last = shifted[0].item(), shifted[-1].item()
        shifted = classic.respaced_sigmas(spacing, first, last, num_inference_steps)

    sigmas32 = np.asarray(shifted).astype(np.float32)
    final = 0.0
    if options.invert_sigmas:
        sigmas32 = 1.0 - sigmas32
        final = 1.0
    timesteps = sigmas32 * np.float32(options.num_train_timesteps)
    return np.concatenate([sigmas32, np.full(1, final, np.float32)]), timesteps


def flow_euler_sigmas(
    num_inference_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side schedule ``(sigmas[N + 1], timesteps[N])`` of the defaults with a static shift.

    diffusers first builds a shifted *training* grid in float32 (``sigma_max``, ``sigma_min`` are
    its ends), spaces the inference timesteps linearly between those ends in float64, and then
    applies the shift a second time. The double shift is what the reference does, so it is what
    we reproduce; ``sigma_max`` is always 1.
    """
    options = FlowEulerOptions(num_train_timesteps=num_train_timesteps, shift=shift)
    return flow_euler_schedule(options, num_inference_steps)


# ---------------------------------------------------------------- sampler state


def _state(sigmas: np.ndarray, timesteps_: np.ndarray) -> FlowEulerState:
    return FlowEulerState(
        sigmas=jnp.asarray(sigmas),
        timesteps=jnp.asarray(timesteps_),
        step_index=jnp.zeros((), jnp.int32),
    )


def make_flow_euler(
    num_inference_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000
) -> FlowEulerState:
    """Builds the Euler sampler state for ``num_inference_steps`` steps with a static ``shift``."""
    return _state(*flow_euler_sigmas(num_inference_steps, shift, num_train_timesteps))


def make_flow_euler_from_options(
    options: FlowEulerOptions,
    num_inference_steps: int | None = None,
    *,
    sigmas: Sequence[float] | np.ndarray | None = None,
    mu: float | None = None,
) -> FlowEulerState:
    """Builds the Euler sampler state for any supported configuration (see
    :func:`flow_euler_schedule` for the arguments); step it with :func:`flow_euler_step`."""
    return _state(*flow_euler_schedule(options, num_inference_steps, sigmas=sigmas, mu=mu))


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
