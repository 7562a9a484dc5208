"""UniPC multistep sampler for flow-matching models: pure, jittable, step-for-step diffusers.

Reference: UniPC, "A Unified Predictor-Corrector Framework for Fast Sampling of Diffusion
Models" (Zhao et al., arXiv 2302.04867), as implemented by diffusers
``UniPCMultistepScheduler`` (scheduling_unipc_multistep.py) in the configuration Wan 2.1 uses:
``prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=s, predict_x0=True,
solver_type="bh2", solver_order=2, lower_order_final=True, final_sigmas_type="zero"``.

With flow sigmas ``alpha_t = 1 - sigma_t`` and the log-SNR is ``lambda = log(alpha) -
log(sigma)``. Each step converts the velocity to a data prediction ``x0 = x - sigma v``, first
corrects the sample the previous step produced (UniC, using the new ``x0``), then predicts the
next sample (UniP) from the last ``order`` data predictions.

Everything that varies per step (the step index, the effective order, the history of data
predictions, the last sample) lives in :class:`UniPCState` with fixed shapes, so
:func:`unipc_step` works with a traced step index inside ``jax.jit`` / ``lax.fori_loop``. The
per-step order is chosen with ``lax.switch`` over branches that each have a static order, so
each branch is exactly the reference formula for that order.

Scope: flow prediction with ``predict_x0=True`` only (diffusers rejects ``predict_x0=False``
for flow models), no ``solver_p``, no thresholding. One deliberate difference: with
``solver_type="bh1"`` diffusers returns NaN on the last step (``B(h) = -h = -inf`` times a
zero residual); we return the exact limit, the data prediction. bh2 (Wan) has no such case.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

SOLVER_TYPES = ("bh1", "bh2")


@struct.dataclass
class UniPCState:
    """Sampler state (a pytree; the last four fields are static configuration).

    Attributes:
      sigmas: ``[N + 1]`` float32 flow sigmas, decreasing, the last one 0.
      timesteps: ``[N]`` int32 model timesteps (``int(sigma * 1000)`` as diffusers truncates).
      step_index: int32 scalar, the step the next :func:`unipc_step` takes.
      model_outputs: ``[solver_order, *sample_shape]`` float32 data predictions of the last
        steps, oldest first (slot ``-1`` is the newest), or ``None`` until the first step
        allocates it (pass ``sample_shape`` to :func:`make_unipc` to use ``lax.fori_loop``).
      last_sample: the sample the previous predictor started from (the corrector's ``x``).
      corrector_enabled: ``[N]`` bool, False where ``disable_corrector`` switches UniC off.
      solver_order, solver_type, lower_order_final: as in diffusers.
    """

    sigmas: jax.Array
    timesteps: jax.Array
    step_index: jax.Array
    model_outputs: jax.Array | None
    last_sample: jax.Array | None
    corrector_enabled: jax.Array
    solver_order: int = struct.field(pytree_node=False, default=2)
    solver_type: str = struct.field(pytree_node=False, default="bh2")
    lower_order_final: bool = struct.field(pytree_node=False, default=True)

    @property
    def num_inference_steps(self) -> int:
        """Number of model evaluations in the schedule (static: read from the array shape)."""
        return self.timesteps.shape[0]


def unipc_flow_sigmas(
    num_inference_steps: int, flow_shift: float, num_train_timesteps: int = 1000
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side ``(sigmas[N + 1] float32, timesteps[N] int)`` exactly as diffusers computes them.

    ``sigmas = shift(linspace(1, 1/T, N + 1)[:-1])`` in float64; a first sigma of 1 is nudged
    down by 1e-6 so ``log(alpha)`` stays finite; timesteps are ``sigma * T`` truncated to int;
    the final sigma is 0 (``final_sigmas_type="zero"``).
    """
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if flow_shift <= 0:
        raise ValueError(f"flow_shift must be > 0, got {flow_shift}")
    sigmas = np.linspace(1, 1 / num_train_timesteps, num_inference_steps + 1)[:-1]
    sigmas = flow_shift * sigmas / (1 + (flow_shift - 1) * sigmas)
    if abs(sigmas[0] - 1) < 1e-6:
        sigmas[0] -= 1e-6
    timesteps = (sigmas * num_train_timesteps).astype(np.int64)
    sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
    return sigmas, timesteps


def make_unipc(
    num_inference_steps: int,
    flow_shift: float = 1.0,
    *,
    solver_order: int = 2,
    solver_type: str = "bh2",
    lower_order_final: bool = True,
    disable_corrector: Sequence[int] = (),
    num_train_timesteps: int = 1000,
    sample_shape: Sequence[int] | None = None,
) -> UniPCState:
    """Builds the UniPC state (Wan's configuration by default).

    Args:
      num_inference_steps: number of model evaluations.
      flow_shift: static timestep shift (Wan 2.1: 3.0 at 480p, 5.0 at 720p).
      solver_order: UniP order (>= 1); the corrector then has effective order ``+1``.
      solver_type: ``"bh2"`` (Wan) or ``"bh1"``, the choice of ``B(h)`` in the paper.
      lower_order_final: use lower orders on the last steps. Must stay True for
        ``solver_order >= 2`` with a final sigma of 0: the reference divides by an infinite
        step there otherwise and produces NaN.
      disable_corrector: step indices after which UniC is skipped, as in diffusers.
      sample_shape: shape of the latents. Given, the history buffers are allocated now so the
        state has fixed shapes for ``lax.fori_loop``; otherwise the first step allocates them.
    """
    if solver_order < 1:
        raise ValueError(f"solver_order must be >= 1, got {solver_order}")
    if solver_type not in SOLVER_TYPES:
        raise ValueError(f"solver_type must be one of {SOLVER_TYPES}, got {solver_type!r}")
    if solver_order >= 2 and not lower_order_final:
        raise ValueError(
            "lower_order_final=False with solver_order >= 2 divides by an infinite step at the "
            "final sigma 0 (NaN in the reference too); keep lower_order_final=True"
        )
    sigmas, timesteps_int = unipc_flow_sigmas(num_inference_steps, flow_shift, num_train_timesteps)
    enabled = np.ones(num_inference_steps, bool)
    for index in disable_corrector:
        # diffusers skips the corrector at step k when k - 1 is listed.
        if 0 <= index + 1 < num_inference_steps:
            enabled[index + 1] = False
    state = UniPCState(
        sigmas=jnp.asarray(sigmas),
        timesteps=jnp.asarray(timesteps_int, jnp.int32),
        step_index=jnp.zeros((), jnp.int32),
        model_outputs=None,
        last_sample=None,
        corrector_enabled=jnp.asarray(enabled),
        solver_order=solver_order,
        solver_type=solver_type,
        lower_order_final=lower_order_final,
    )
    if sample_shape is not None:
        state = _with_history(state, tuple(sample_shape))
    return state


# scheduler_config.json values this implementation requires (anything else is refused).
_REQUIRED_CONFIG = {
    "prediction_type": "flow_prediction",
    "use_flow_sigmas": True,
    "predict_x0": True,
    "final_sigmas_type": "zero",
    "thresholding": False,
}


def unipc_options(config: Mapping[str, Any], where: str) -> dict[str, Any]:
    """:func:`make_unipc` keyword options from a diffusers ``scheduler_config.json`` dict.

    Only the flow-matching UniPC above is implemented: a config that asks for anything else
    (epsilon prediction, no flow sigmas, thresholding, ...) is an error naming the key.
    """
    for key, want in _REQUIRED_CONFIG.items():
        if key in config and config[key] != want:
            raise ValueError(f"{where}: {key}={config[key]!r} is not supported (only {want!r})")
    return {
        "solver_order": int(config.get("solver_order", 2)),
        "solver_type": str(config.get("solver_type", "bh2")),
        "lower_order_final": bool(config.get("lower_order_final", True)),
        "disable_corrector": tuple(config.get("disable_corrector") or ()),
        "num_train_timesteps": int(config.get("num_train_timesteps", 1000)),
    }


def timesteps(state: UniPCState) -> jax.Array:
    """The ``[N]`` int32 timesteps to feed the model, one per step."""
    return state.timesteps


def _with_history(state: UniPCState, sample_shape: tuple[int, ...]) -> UniPCState:
    """Allocates zeroed history buffers of the sample's shape (float32)."""
    return state.replace(
        model_outputs=jnp.zeros((state.solver_order, *sample_shape), jnp.float32),
        last_sample=jnp.zeros(sample_shape, jnp.float32),
    )


def _log_snr(sigma: jax.Array) -> jax.Array:
    """``lambda = log(alpha) - log(sigma)`` with flow sigmas ``alpha = 1 - sigma``."""
    return jnp.log(1 - sigma) - jnp.log(sigma)


def _step_order(state: UniPCState, index: jax.Array) -> jax.Array:
    """Order of the UniP update taken at step ``index`` (warm-up, and lower order at the end).

    diffusers: ``min(solver_order, N - index if lower_order_final, lower_order_nums + 1)`` where
    ``lower_order_nums`` counts the steps taken so far, capped at ``solver_order``.
    """
    order = jnp.minimum(state.solver_order, index + 1)
    if state.lower_order_final:
        order = jnp.minimum(order, state.num_inference_steps - index)
    return order


def _solver_coefficients(hh: jax.Array, rks: jax.Array, order: int, solver_type: str):
    """The ``R`` (Vandermonde in ``r_k``) and ``b`` system of UniPC with ``B(h)`` (paper eq. 6).

    ``hh = -h`` (data prediction). Returns ``(R[order, order], b[order], h_phi_1, B_h)``.
    """
    h_phi_1 = jnp.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    b_h = hh if solver_type == "bh1" else jnp.expm1(hh)
    rows, b = [], []
    factorial = 1
    for i in range(1, order + 1):
        rows.append(rks ** (i - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= i + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return jnp.stack(rows), jnp.stack(b), h_phi_1, b_h


def _history_differences(state, lambda_s0, h, m0, first_sigma_index, order):
    """``r_k`` and ``D1_k = (m_k - m0) / r_k`` for the ``order - 1`` older data predictions.

    The k-th older prediction (history slot ``-(k + 1)``) sits at sigma index
    ``first_sigma_index - (k - 1)``.
    """
    rks, d1s = [], []
    for k in range(1, order):
        sigma_k = state.sigmas[first_sigma_index - (k - 1)]
        rk = (_log_snr(sigma_k) - lambda_s0) / h
        rks.append(rk)
        d1s.append((state.model_outputs[-(k + 1)] - m0) / rk)
    rks.append(jnp.ones((), jnp.float32))
    return jnp.stack(rks), d1s


def _predict(state: UniPCState, sample: jax.Array, index: jax.Array, order: int) -> jax.Array:
    """UniP-``order`` (B(h) variant) from sigma ``index`` to ``index + 1`` (diffusers
    ``multistep_uni_p_bh_update`` with ``predict_x0=True``); history slot -1 is the newest x0."""
    m0 = state.model_outputs[-1]
    sigma_s0, sigma_t = state.sigmas[index], state.sigmas[index + 1]
    lambda_s0, lambda_t = _log_snr(sigma_s0), _log_snr(sigma_t)
    h = lambda_t - lambda_s0
    rks, d1s = _history_differences(state, lambda_s0, h, m0, index - 1, order)
    r_matrix, b, h_phi_1, b_h = _solver_coefficients(-h, rks, order, state.solver_type)
    alpha_t = 1 - sigma_t
    x_t = sigma_t / sigma_s0 * sample - alpha_t * h_phi_1 * m0
    if order == 1:
        return x_t
    # Order 2 uses rho = 1/2 (the paper's simplified choice); higher orders solve the system.
    if order == 2:
        rhos = jnp.full((1,), 0.5, jnp.float32)
    else:
        rhos = jnp.linalg.solve(r_matrix[:-1, :-1], b[:-1])
    pred_res = sum(rho * d1 for rho, d1 in zip(rhos, d1s, strict=True))
    return x_t - alpha_t * b_h * pred_res


def _correct(
    state: UniPCState, x0_pred: jax.Array, unused_sample: jax.Array, index: jax.Array, order: int
) -> jax.Array:
    """UniC-``order``: the corrected sample at sigma ``index`` (diffusers
    ``multistep_uni_c_bh_update``).

    It re-integrates from ``state.last_sample`` (sigma ``index - 1``) with the new data
    prediction ``x0_pred``; the uncorrected sample itself is not an input of the formula (the
    argument only keeps the ``lax.switch`` branch signatures uniform).
    """
    m0 = state.model_outputs[-1]
    sigma_s0, sigma_t = state.sigmas[index - 1], state.sigmas[index]
    lambda_s0, lambda_t = _log_snr(sigma_s0), _log_snr(sigma_t)
    h = lambda_t - lambda_s0
    rks, d1s = _history_differences(state, lambda_s0, h, m0, index - 2, order)
    r_matrix, b, h_phi_1, b_h = _solver_coefficients(-h, rks, order, state.solver_type)
    if order == 1:
        rhos = jnp.full((1,), 0.5, jnp.float32)
    else:
        rhos = jnp.linalg.solve(r_matrix, b)
    alpha_t = 1 - sigma_t
    x_t = sigma_t / sigma_s0 * state.last_sample - alpha_t * h_phi_1 * m0
    corr_res = sum((rho * d1 for rho, d1 in zip(rhos[:-1], d1s, strict=True)), 0.0)
    return x_t - alpha_t * b_h * (corr_res + rhos[-1] * (x0_pred - m0))


def _switch(branch: jax.Array, branches, *operands):
    """``lax.switch``, but a concrete branch index (eager use) calls that branch directly.

    Eager ``lax.switch`` re-traces and compiles every branch on each call (seconds per step);
    under ``jit`` the index is traced and ``lax.switch`` runs only the selected branch.
    """
    try:
        chosen = int(branch)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return jax.lax.switch(branch, branches, *operands)
    return branches[chosen](*operands)


def unipc_step(
    state: UniPCState, model_output: jax.Array, sample: jax.Array
) -> tuple[jax.Array, UniPCState]:
    """One UniPC step at ``state.step_index``; returns ``(prev_sample, new_state)``.

    ``model_output`` is the predicted flow velocity at ``sample`` and
    ``timesteps(state)[state.step_index]``. Mirrors diffusers ``UniPCMultistepScheduler.step``:
    convert to ``x0``, apply UniC to ``sample`` (from the second step on), push ``x0`` into the
    history, then UniP to the next sigma. Computed in float32; the result has ``sample``'s dtype.
    """
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output shape {model_output.shape} != sample shape {sample.shape}")
    if state.model_outputs is None:
        state = _with_history(state, sample.shape)
    elif state.last_sample.shape != sample.shape:
        raise ValueError(
            f"sample shape {sample.shape} != the shape UniPCState was built for "
            f"{state.last_sample.shape}"
        )
    out_dtype = sample.dtype
    x = sample.astype(jnp.float32)
    index = state.step_index
    x0_pred = x - state.sigmas[index] * model_output.astype(jnp.float32)

    # Corrector order 0 means "no correction": step 0 (nothing to correct) or disabled there.
    corrector_order = jnp.where(
        (index > 0) & state.corrector_enabled[index], _step_order(state, index - 1), 0
    )
    correctors = [lambda s, x0, x_: x_] + [
        functools.partial(_correct, index=index, order=order)
        for order in range(1, state.solver_order + 1)
    ]
    x = _switch(corrector_order, correctors, state, x0_pred, x)

    history = jnp.concatenate([state.model_outputs[1:], x0_pred[None]], axis=0)
    state = state.replace(model_outputs=history, last_sample=x)

    predictors = [
        functools.partial(_predict, index=index, order=order)
        for order in range(1, state.solver_order + 1)
    ]
    prev_sample = _switch(_step_order(state, index) - 1, predictors, state, x)
    return prev_sample.astype(out_dtype), state.replace(step_index=index + 1)


__all__ = [
    "UniPCState",
    "make_unipc",
    "timesteps",
    "unipc_flow_sigmas",
    "unipc_step",
]
