"""Pure, jittable samplers/schedulers, chosen by name from config.

Every sampler has the same shape: ``make_*`` builds a state pytree (schedule + step index +
any multistep history) on the host; ``step_fn(state, model_output, sample) -> (prev_sample,
state)`` advances it by one step and can run under ``jax.jit`` / ``lax.fori_loop`` with the
step index traced. A sampling loop reads::

    state, step_fn = make_scheduler("unipc", 50, shift=5.0, sample_shape=latents.shape)
    for i in range(num_steps(state)):
        v = model(latents, timesteps(state)[i])
        latents, state = step_fn(state, v, latents)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxcore.schedulers.flow_euler import (
    FlowEulerConfigError,
    FlowEulerOptions,
    FlowEulerState,
    calculate_shift,
    flow_euler_options,
    flow_euler_schedule,
    flow_euler_step,
    flux_mu,
    flux_sigmas,
    make_flow_euler,
    make_flow_euler_from_options,
)
from jaxcore.schedulers.unipc import UniPCState, make_unipc, unipc_step

StepFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]

SCHEDULERS: tuple[str, ...] = ("unipc", "flow_euler")


def _euler_step(state: FlowEulerState, model_output: jax.Array, sample: jax.Array):
    """Euler step at ``state.step_index`` (the registry's uniform step signature)."""
    return flow_euler_step(state, model_output, sample)


def _make_euler(
    num_inference_steps: int,
    shift: float,
    *,
    euler_options: FlowEulerOptions | None = None,
    sigmas: Sequence[float] | None = None,
    mu: float | None = None,
    **options: Any,
) -> FlowEulerState:
    """:func:`make_flow_euler`, or with any of ``euler_options``/``sigmas``/``mu``
    :func:`make_flow_euler_from_options` where ``shift`` replaces ``euler_options.shift``."""
    if euler_options is None and sigmas is None and mu is None:
        return make_flow_euler(num_inference_steps, shift, **options)
    if euler_options is None:
        euler_options = FlowEulerOptions(shift=shift, **options)
    elif options:
        raise TypeError(f"give either euler_options or {sorted(options)}, not both")
    else:
        euler_options = dataclasses.replace(euler_options, shift=shift)
    return make_flow_euler_from_options(euler_options, num_inference_steps, sigmas=sigmas, mu=mu)


def make_scheduler(
    name: str,
    num_inference_steps: int,
    shift: float,
    *,
    sample_shape: Sequence[int] | None = None,
    **options: Any,
) -> tuple[FlowEulerState | UniPCState, StepFn]:
    """Builds the sampler ``name`` and returns ``(state, step_fn)``.

    Args:
      name: ``"unipc"`` (diffusers ``UniPCMultistepScheduler`` with flow sigmas, Wan's default)
        or ``"flow_euler"`` (diffusers ``FlowMatchEulerDiscreteScheduler``).
      num_inference_steps: number of model evaluations.
      shift: static timestep shift (``flow_shift``).
      sample_shape: latent shape; UniPC needs it to allocate its history before a
        ``lax.fori_loop`` (ignored by Euler, which keeps no history).
      **options: extra keyword arguments of :func:`make_unipc` / :func:`make_flow_euler`. For
        ``"flow_euler"`` also ``euler_options`` (a :class:`FlowEulerOptions`, e.g. Flux's, read
        by :func:`flow_euler_options`; ``shift`` replaces its ``shift``), ``sigmas`` and ``mu``
        as :func:`make_flow_euler_from_options` takes them.
    """
    if name == "unipc":
        state = make_unipc(num_inference_steps, shift, sample_shape=sample_shape, **options)
        return state, unipc_step
    if name == "flow_euler":
        return _make_euler(num_inference_steps, shift, **options), _euler_step
    raise ValueError(f"unknown scheduler {name!r}; expected one of {SCHEDULERS}")


def timesteps(state: FlowEulerState | UniPCState) -> jax.Array:
    """The ``[N]`` timesteps to feed the model (any scheduler state)."""
    return state.timesteps


def num_steps(state: FlowEulerState | UniPCState) -> int:
    """Number of model evaluations in the schedule (static)."""
    return state.timesteps.shape[0]


__all__ = [
    "SCHEDULERS",
    "FlowEulerConfigError",
    "FlowEulerOptions",
    "FlowEulerState",
    "StepFn",
    "UniPCState",
    "calculate_shift",
    "flow_euler_options",
    "flow_euler_schedule",
    "flow_euler_step",
    "flux_mu",
    "flux_sigmas",
    "make_flow_euler",
    "make_flow_euler_from_options",
    "make_scheduler",
    "make_unipc",
    "num_steps",
    "timesteps",
    "unipc_step",
]
