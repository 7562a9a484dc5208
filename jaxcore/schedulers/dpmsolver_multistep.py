"""DPM-Solver(++) multistep sampler: a pure, jittable twin of diffusers' DPMSolverMultistepScheduler.

Reference: diffusers ``DPMSolverMultistepScheduler`` (scheduling_dpmsolver_multistep.py);
DPM-Solver (Lu et al., arXiv 2206.00927) and DPM-Solver++ (Lu et al., arXiv 2211.01095; the SDE
variant is its section 5). With ``alpha = 1 / sqrt(1 + sigma^2)``, ``sigma_t = sigma alpha`` and
the half log-SNR ``lambda = log alpha - log sigma_t``, a step of step size ``h = lambda_next -
lambda`` combines the last ``k <= solver_order`` converted model outputs ``m`` (data predictions
for ``dpmsolver++``, noise predictions for ``dpmsolver``) through their divided differences::

    x' = A x - B D0 - C D1 - E D2 (+ S z for sde-dpmsolver++),
    D0 = m0, D1 = (m0 - m1) / r0 (order 2) or the order-3 combination, D2 (order 3 only).

The order of each step follows diffusers: it warms up (1, 2, 3, ...), and the last step (and with
fewer than 15 steps the one before) lowers it as ``lower_order_final``, ``euler_at_final`` and a
final sigma of 0 ask. All of that is fixed by the step index, so the host precomputes, per step,
the scalars ``A, B, C, E, S`` and the ``1 / r`` weights of the divided differences (zero where
the step's order does not use them) in diffusers' float32 arithmetic; a step then only combines
tensors, with no branch on the traced step index.

Parity: timesteps equal diffusers', sigmas to 1e-6 relative (ulps of PyTorch's float32 sqrt);
over whole loops (1-50 steps, orders 1-3, midpoint/heun, dpmsolver++/dpmsolver/sde-dpmsolver++
(fed diffusers' noise), epsilon/v/sample prediction, every spacing, zero-SNR, Karras/Lu/
exponential/beta sigmas, final sigma 0 or sigma_min, lower_order_final off, euler_at_final)
every intermediate sample matches diffusers' float32 to 6e-7 of the largest sample magnitude so
far; ill-conditioned schedules (epsilon prediction at alpha ~ 1e-4) to 3e-6, no more than
diffusers moves under a one-ulp change of its input (tests/jaxcore/test_classic_schedulers.py).

Refused (ClassicConfigError): ``thresholding``, ``variance_type`` learned/learned_range,
``use_flow_sigmas``/``flow_prediction`` and ``use_dynamic_shifting`` (flow models: use
:mod:`~jaxcore.schedulers.unipc` or :mod:`~jaxcore.schedulers.flow_euler`), the deprecated
``sde-dpmsolver`` and ``solver_order > 3``. Like diffusers, ``algorithm_type="deis"`` reads as
``dpmsolver++`` and ``solver_type`` ``logrho``/``bh1``/``bh2`` as ``midpoint`` (so DEIS and UniPC
configs load). The schedule assumes sampling starts at step 0 (no img2img ``begin_index``).
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
from jaxcore.schedulers.classic import ClassicConfigError, NoiseScheduleConfig, f32

ALGORITHM_TYPES = ("dpmsolver++", "dpmsolver", "sde-dpmsolver++")
SOLVER_TYPES = ("midpoint", "heun")
FINAL_SIGMAS_TYPES = ("zero", "sigma_min")
# Values diffusers itself rewrites when it builds the scheduler (configs of DEIS / UniPC).
_ALGORITHM_ALIASES = {"deis": "dpmsolver++"}
_SOLVER_ALIASES = {"logrho": "midpoint", "bh1": "midpoint", "bh2": "midpoint"}
# Below this many steps, lower_order_final also lowers the second-to-last step (diffusers).
_LOWER_ORDER_FINAL_STEPS = 15


@dataclasses.dataclass(frozen=True)
class DPMSolverConfig(NoiseScheduleConfig):
    """``DPMSolverMultistepScheduler``'s configuration (diffusers names and defaults).

    Beyond :class:`~jaxcore.schedulers.classic.NoiseScheduleConfig`:
      solver_order: 1, 2 or 3 (SD: 2).
      algorithm_type: ``dpmsolver++`` (data prediction), ``dpmsolver`` (noise prediction) or
        ``sde-dpmsolver++`` (stochastic; needs per-step noise).
      solver_type: ``midpoint`` or ``heun``, the second-order update.
      lower_order_final, euler_at_final: lower the order on the last step(s).
      use_karras_sigmas, use_lu_lambdas, use_exponential_sigmas, use_beta_sigmas: respaced
        sigmas (the timesteps follow); sigma_min/sigma_max bound the Karras/exponential/beta
        ones (not diffusers parameters of this scheduler, but it reads them from the config when
        ``from_config`` carried them over from another scheduler's).
      final_sigmas_type: the last step goes to sigma ``zero`` or the smallest training sigma.
      lambda_min_clipped: drop the timesteps whose log-SNR is below this.
      thresholding, variance_type, use_flow_sigmas, use_dynamic_shifting: refused when set;
        dynamic_thresholding_ratio, sample_max_value, flow_shift, time_shift_type are their
        parameters, accepted and unused.
    """

    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    use_lu_lambdas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -math.inf
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    variance_type: str | None = None
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"

    def _validate(self) -> None:
        object.__setattr__(
            self,
            "algorithm_type",
            _ALGORITHM_ALIASES.get(self.algorithm_type, self.algorithm_type),
        )
        object.__setattr__(
            self, "solver_type", _SOLVER_ALIASES.get(self.solver_type, self.solver_type)
        )
        if self.solver_order not in (1, 2, 3):
            raise ClassicConfigError(f"solver_order={self.solver_order}: expected 1, 2 or 3")
        if self.algorithm_type == "sde-dpmsolver":
            raise ClassicConfigError(
                "algorithm_type='sde-dpmsolver' is not supported (deprecated in diffusers, which "
                "has no third-order update for it); use 'sde-dpmsolver++'"
            )
        classic.check_choice("algorithm_type", self.algorithm_type, ALGORITHM_TYPES)
        classic.check_choice("solver_type", self.solver_type, SOLVER_TYPES)
        classic.check_choice("final_sigmas_type", self.final_sigmas_type, FINAL_SIGMAS_TYPES)
        classic.check_choice("time_shift_type", self.time_shift_type, ("exponential",))
        classic.check_one_sigma_spacing(self)
        if self.algorithm_type == "dpmsolver" and self.final_sigmas_type == "zero":
            raise ClassicConfigError(
                "final_sigmas_type='zero' with algorithm_type='dpmsolver' is refused by diffusers "
                "(the noise-prediction update divides by sigma 0); use 'sigma_min'"
            )
        refused = {
            "thresholding": "dynamic thresholding of x0 (a pixel-space method)",
            "variance_type": "learned variances (the model outputs extra channels)",
            "use_flow_sigmas": "flow-matching sigmas (use the unipc or flow_euler sampler)",
            "use_dynamic_shifting": "resolution-dependent shifting of flow sigmas",
        }
        for name, what in refused.items():
            if getattr(self, name):
                raise ClassicConfigError(f"{name}={getattr(self, name)!r} is not supported: {what}")


@struct.dataclass
class DPMSolverCoefficients:
    """Per-step ``[N]`` float32 scalars of ``x' = A x - B D0 - C D1 - E D2 + S z``.

    Attributes:
      alpha, sigma: ``alpha`` and ``sigma_t`` at the step's own sigma (to convert the output).
      sample_scale, d0_scale, d1_scale, d2_scale, noise_scale: ``A, B, C, E, S`` (0 if unused).
      inv_r0, inv_r1: ``1 / r0``, ``1 / r1``, the divided-difference weights (0 if unused).
      d1_mix, inv_r_sum: ``r0 / (r0 + r1)``, ``1 / (r0 + r1)`` of the third-order ``D1``, ``D2``.
      order: the order each step takes (for inspection; the step does not read it).
    """

    alpha: jax.Array
    sigma: jax.Array
    sample_scale: jax.Array
    d0_scale: jax.Array
    d1_scale: jax.Array
    d2_scale: jax.Array
    noise_scale: jax.Array
    inv_r0: jax.Array
    inv_r1: jax.Array
    d1_mix: jax.Array
    inv_r_sum: jax.Array
    order: jax.Array


@struct.dataclass
class DPMSolverState:
    """Sampler state (a pytree; the last three fields are static configuration).

    Attributes:
      timesteps: ``[N]`` int32 model timesteps, decreasing.
      sigmas: ``[N + 1]`` float32 sigmas (the last 0 or the smallest training sigma).
      step_index: int32 scalar, the step the next :func:`dpmsolver_step` takes.
      coefficients: the per-step :class:`DPMSolverCoefficients`.
      model_outputs: ``[solver_order, *sample_shape]`` float32 converted outputs of the last
        steps, oldest first, or ``None`` until the first step allocates it (pass
        ``sample_shape`` to :func:`make_dpmsolver` to use ``lax.fori_loop``).
      step_noise: ``[N, *sample_shape]`` float32 noise of each step (sde-dpmsolver++), or None.
      prediction_type, algorithm_type, solver_order: as in the config.
    """

    timesteps: jax.Array
    sigmas: jax.Array
    step_index: jax.Array
    coefficients: DPMSolverCoefficients
    model_outputs: jax.Array | None
    step_noise: jax.Array | None
    prediction_type: str = struct.field(pytree_node=False, default="epsilon")
    algorithm_type: str = struct.field(pytree_node=False, default="dpmsolver++")
    solver_order: int = struct.field(pytree_node=False, default=2)

    @property
    def num_inference_steps(self) -> int:
        """Number of model evaluations in the schedule (static: read from the array shape)."""
        return self.timesteps.shape[0]


# ---------------------------------------------------------------- host-side schedule


def _alpha_sigma_lambda(sigmas: np.ndarray):
    """float32 ``(alpha, sigma_t, lambda)`` of each sigma, in diffusers' arithmetic."""
    alpha = f32(1.0) / np.sqrt(sigmas * sigmas + f32(1.0))
    sigma_t = sigmas * alpha
    return alpha, sigma_t, classic.log32(alpha) - classic.log32(sigma_t)


def _spaced_timesteps(config: DPMSolverConfig, num_steps: int, last_timestep: int) -> np.ndarray:
    """DPM-Solver's spacing: ``N + 1`` points dropping the last (0), below ``last_timestep``."""
    if num_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_steps}")
    if config.timestep_spacing == "linspace":
        points = np.linspace(0, last_timestep - 1, num_steps + 1).round()
        return points[::-1][:-1].astype(np.int64)
    if config.timestep_spacing == "leading":
        ratio = last_timestep // (num_steps + 1)
        points = (np.arange(num_steps + 1) * ratio).round()[::-1][:-1].astype(np.int64)
        return points + config.steps_offset
    ratio = config.num_train_timesteps / num_steps
    return np.arange(last_timestep, 0, -ratio).round().astype(np.int64) - 1


def _respaced(
    config: DPMSolverConfig, kind: str, table: np.ndarray, log_table: np.ndarray, num_steps: int
) -> np.ndarray:
    """``num_steps`` float64 sigmas respaced between the training table's ends (not the
    spaced schedule's, unlike Euler): ``lu`` is linear in ``log sigma`` (Lu et al. 2022)."""
    if kind == "lu":
        log_max, log_min = log_table[-1].item(), log_table[0].item()
        ramp = np.linspace(0, 1, num_steps)
        return np.exp(log_max + ramp * (log_min - log_max))
    sigma_max = table[-1].item() if config.sigma_max is None else config.sigma_max
    sigma_min = table[0].item() if config.sigma_min is None else config.sigma_min
    return classic.respaced_sigmas(kind, sigma_max, sigma_min, num_steps)


def dpmsolver_schedule(
    config: DPMSolverConfig, num_inference_steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side ``(sigmas[N + 1] float32, timesteps[N] int64)`` of diffusers'
    ``DPMSolverMultistepScheduler(**config).set_timesteps(N)``, bit for bit."""
    alpha_bar = classic.alphas_cumprod(config, zero_snr_floor=True)
    table = classic.train_sigmas(alpha_bar)
    log_table = np.log(table)  # numpy's float32 log, as diffusers
    train_lambda = classic.log32(np.sqrt(alpha_bar)) - classic.log32(np.sqrt(f32(1.0) - alpha_bar))
    # lambda decreases with t: the timesteps above the first one below the clip are dropped.
    clipped = np.searchsorted(train_lambda[::-1], config.lambda_min_clipped)
    timesteps = _spaced_timesteps(
        config, num_inference_steps, config.num_train_timesteps - int(clipped)
    )
    # diffusers' precedence: Karras, then Lu's lambdas, then exponential, then beta.
    if config.use_karras_sigmas:
        kind = "karras"
    elif config.use_lu_lambdas:
        kind = "lu"
    else:
        kind = classic.sigma_spacing(config)
    if kind is None:
        sigmas = np.interp(timesteps, np.arange(len(table)), table)
    else:
        sigmas = _respaced(config, kind, table, log_table, num_inference_steps)
        timesteps = classic.sigma_to_timestep(sigmas, log_table)
        if kind in ("karras", "lu") and config.beta_schedule != "squaredcos_cap_v2":
            timesteps = timesteps.round()
    last = table[0] if config.final_sigmas_type == "sigma_min" else 0.0
    sigmas = np.concatenate([sigmas, [last]]).astype(f32)
    return sigmas, timesteps.astype(np.int64)  # truncates toward 0, as torch's .to(int64)


def step_orders(config: DPMSolverConfig, num_steps: int) -> np.ndarray:
    """The solver order diffusers uses at each of ``num_steps`` steps taken from step 0."""
    orders = np.empty(num_steps, np.int32)
    few_steps = config.lower_order_final and num_steps < _LOWER_ORDER_FINAL_STEPS
    for index in range(num_steps):
        warmed_up = min(index, config.solver_order)  # diffusers' lower_order_nums
        last = index == num_steps - 1 and (
            config.euler_at_final or few_steps or config.final_sigmas_type == "zero"
        )
        second_last = index == num_steps - 2 and few_steps
        if config.solver_order == 1 or warmed_up < 1 or last:
            orders[index] = 1
        elif config.solver_order == 2 or warmed_up < 2 or second_last:
            orders[index] = 2
        else:
            orders[index] = 3
    return orders


def _update_scales(config: DPMSolverConfig, alpha_t, sigma_t, alpha_s, sigma_s, h, order: int):
    """``(A, B, C, E, S)`` of one step of ``order`` with step size ``h`` (float32 scalars).

    Each is diffusers' coefficient in its float32 evaluation order, signed for
    ``x' = A x - B D0 - C D1 - E D2 + S z``.
    """
    zero = f32(0.0)
    c_scale = e_scale = s_scale = zero
    if config.algorithm_type == "dpmsolver++":
        decay = classic.exp32(-h) - f32(1.0)  # e^-h - 1
        a_scale, b_scale = sigma_t / sigma_s, alpha_t * decay
        heun_d1 = -(alpha_t * (decay / h + f32(1.0)))
        if order == 2:
            c_scale = f32(0.5) * b_scale if config.solver_type == "midpoint" else heun_d1
        elif order == 3:
            c_scale = heun_d1
            e_scale = alpha_t * ((decay + h) / (h * h) - f32(0.5))
    elif config.algorithm_type == "dpmsolver":
        growth = classic.exp32(h) - f32(1.0)  # e^h - 1
        a_scale, b_scale = alpha_t / alpha_s, sigma_t * growth
        heun_d1 = sigma_t * (growth / h - f32(1.0))
        if order == 2:
            c_scale = f32(0.5) * b_scale if config.solver_type == "midpoint" else heun_d1
        elif order == 3:
            c_scale = heun_d1
            e_scale = sigma_t * ((growth - h) / (h * h) - f32(0.5))
    else:  # sde-dpmsolver++
        two_h = f32(2.0) * h
        kept = f32(1.0) - classic.exp32(-two_h)  # 1 - e^-2h
        a_scale = sigma_t / sigma_s * classic.exp32(-h)
        b_scale = -(alpha_t * kept)
        s_scale = sigma_t * np.sqrt(kept)
        heun_d1 = -(alpha_t * (kept / -two_h + f32(1.0)))
        if order == 2:
            c_scale = (
                -(f32(0.5) * (alpha_t * kept)) if config.solver_type == "midpoint" else heun_d1
            )
        elif order == 3:
            c_scale = heun_d1
            e_scale = -(alpha_t * ((kept - two_h) / (two_h * two_h) - f32(0.5)))
    return a_scale, b_scale, c_scale, e_scale, s_scale


def dpmsolver_coefficients(
    config: DPMSolverConfig, sigmas: np.ndarray, num_steps: int
) -> dict[str, np.ndarray]:
    """The per-step float32 scalars of :class:`DPMSolverCoefficients` (host numpy)."""
    alpha, sigma_t, lam = _alpha_sigma_lambda(sigmas)
    orders = step_orders(config, num_steps)
    names = ("sample_scale", "d0_scale", "d1_scale", "d2_scale", "noise_scale")
    names += ("inv_r0", "inv_r1", "d1_mix", "inv_r_sum")
    table = {name: np.zeros(num_steps, f32) for name in names}
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for i, order in enumerate(orders):
            h = lam[i + 1] - lam[i]
            scales = _update_scales(
                config, alpha[i + 1], sigma_t[i + 1], alpha[i], sigma_t[i], h, int(order)
            )
            for name, value in zip(names[:5], scales, strict=True):
                table[name][i] = value
            if order >= 2:
                r0 = (lam[i] - lam[i - 1]) / h
                table["inv_r0"][i] = f32(1.0) / r0
            if order == 3:
                r1 = (lam[i - 1] - lam[i - 2]) / h
                table["inv_r1"][i] = f32(1.0) / r1
                table["d1_mix"][i] = r0 / (r0 + r1)
                table["inv_r_sum"][i] = f32(1.0) / (r0 + r1)
    return dict(table, alpha=alpha[:num_steps], sigma=sigma_t[:num_steps], order=orders)


def make_dpmsolver(
    num_inference_steps: int,
    config: DPMSolverConfig | Mapping[str, Any] | None = None,
    *,
    noise: Any = None,
    seeds: Sequence[int] | None = None,
    sample_shape: Sequence[int] | None = None,
) -> DPMSolverState:
    """Builds the DPM-Solver state; step it with :func:`dpmsolver_step`.

    Args:
      num_inference_steps: number of model evaluations ``N``.
      config: a :class:`DPMSolverConfig`, a diffusers ``scheduler_config.json`` dict (read as
        ``DPMSolverMultistepScheduler.from_config`` would), or ``None`` for the defaults.
      noise: for ``sde-dpmsolver++``, the ``[N, *sample_shape]`` noise of each step (diffusers'
        ``variance_noise``), or
      seeds: for ``sde-dpmsolver++``, one seed per batch element to draw it on the host with
        :func:`~jaxcore.schedulers.classic.step_noise`.
      sample_shape: latent shape; given, the history is allocated now so the state has fixed
        shapes for ``lax.fori_loop`` (otherwise the first step allocates it).
    """
    config = classic.as_config(DPMSolverConfig, config)
    sigmas, timesteps = dpmsolver_schedule(config, num_inference_steps)
    steps = len(timesteps)
    coefficients = dpmsolver_coefficients(config, sigmas, steps)
    step_noise = None
    if config.algorithm_type == "sde-dpmsolver++":
        step_noise = classic.checked_noise(noise, seeds, steps, sample_shape)
    elif noise is not None or seeds is not None:
        raise ValueError("noise/seeds are only used with algorithm_type='sde-dpmsolver++'")
    state = DPMSolverState(
        timesteps=jnp.asarray(timesteps, jnp.int32),
        sigmas=jnp.asarray(sigmas),
        step_index=jnp.zeros((), jnp.int32),
        coefficients=DPMSolverCoefficients(
            **{name: jnp.asarray(value) for name, value in coefficients.items()}
        ),
        model_outputs=None,
        step_noise=step_noise,
        prediction_type=config.prediction_type,
        algorithm_type=config.algorithm_type,
        solver_order=config.solver_order,
    )
    if sample_shape is not None:
        state = _with_history(state, tuple(sample_shape))
    return state


def _with_history(state: DPMSolverState, sample_shape: tuple[int, ...]) -> DPMSolverState:
    return state.replace(model_outputs=jnp.zeros((state.solver_order, *sample_shape), jnp.float32))


# ---------------------------------------------------------------- stepping


def _converted_output(state: DPMSolverState, index, model_output, sample):
    """The model output as the solver's ``m``: the data prediction (``dpmsolver++``, SDE) or
    the noise prediction (``dpmsolver``), as diffusers' ``convert_model_output``."""
    alpha, sigma = state.coefficients.alpha[index], state.coefficients.sigma[index]
    kind = state.prediction_type
    if state.algorithm_type == "dpmsolver":
        if kind == "epsilon":
            return model_output
        if kind == "v_prediction":
            return alpha * model_output + sigma * sample
        return (sample - alpha * model_output) / sigma
    if kind == "epsilon":
        return (sample - sigma * model_output) / alpha
    if kind == "v_prediction":
        return alpha * sample - sigma * model_output
    return model_output


def _update(state: DPMSolverState, index, sample, history) -> jax.Array:
    """``A x - B D0 - C D1 - E D2`` from the history (newest last); unused terms have zero
    coefficients, so one expression serves every order."""
    c = state.coefficients
    m0 = history[-1]
    x = c.sample_scale[index] * sample - c.d0_scale[index] * m0
    if state.solver_order == 1:
        return x
    d1_newest = c.inv_r0[index] * (m0 - history[-2])
    if state.solver_order == 2:
        return x - c.d1_scale[index] * d1_newest
    d1_older = c.inv_r1[index] * (history[-2] - history[-3])
    d1 = d1_newest + c.d1_mix[index] * (d1_newest - d1_older)
    d2 = c.inv_r_sum[index] * (d1_newest - d1_older)
    return x - c.d1_scale[index] * d1 - c.d2_scale[index] * d2


def dpmsolver_step(
    state: DPMSolverState, model_output: jax.Array, sample: jax.Array
) -> tuple[jax.Array, DPMSolverState]:
    """One DPM-Solver step at ``state.step_index``; returns ``(prev_sample, new_state)``.

    ``model_output`` is the model's prediction at ``sample`` and
    ``state.timesteps[state.step_index]``. Computed in float32; the result has ``sample``'s dtype.
    """
    output, x = classic.float32_step_inputs(model_output, sample)
    if state.model_outputs is None:
        state = _with_history(state, sample.shape)
    elif state.model_outputs.shape[1:] != sample.shape:
        raise ValueError(
            f"sample shape {sample.shape} != the shape DPMSolverState was built for "
            f"{state.model_outputs.shape[1:]}"
        )
    index = state.step_index
    converted = _converted_output(state, index, output, x)
    history = jnp.concatenate([state.model_outputs[1:], converted[None]], axis=0)
    prev = _update(state, index, x, history)
    if state.step_noise is not None:
        prev = prev + state.coefficients.noise_scale[index] * state.step_noise[index]
    new_state = state.replace(model_outputs=history, step_index=index + 1)
    return prev.astype(sample.dtype), new_state


# DPM-Solver feeds the model the sample unscaled, and its latents start as standard normal.
scale_model_input = classic.unscaled_model_input
init_noise_sigma = classic.unit_noise_sigma


__all__ = [
    "DPMSolverCoefficients",
    "DPMSolverConfig",
    "DPMSolverState",
    "dpmsolver_coefficients",
    "dpmsolver_schedule",
    "dpmsolver_step",
    "init_noise_sigma",
    "make_dpmsolver",
    "scale_model_input",
    "step_orders",
]
