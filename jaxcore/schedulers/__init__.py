"""Pure, jittable samplers/schedulers, chosen by name from config.

Every sampler has the same shape: ``make_*`` builds a state pytree (schedule + step index +
any multistep history) on the host; ``step_fn(state, model_output, sample) -> (prev_sample,
state)`` advances it by one step and can run under ``jax.jit`` / ``lax.fori_loop`` with the
step index traced. A sampling loop reads::

    state, step_fn = make_scheduler("unipc", 50, shift=5.0, sample_shape=latents.shape)
    latents = latents * init_noise_sigma(state)
    for i in range(num_steps(state)):
        v = model(scale_model_input(state, latents), timesteps(state)[i])
        latents, state = step_fn(state, v, latents)

Two kinds are registered: the flow-matching samplers (:data:`SCHEDULERS`: Wan, Flux) and the
classic DDPM-trained ones (:data:`CLASSIC_SCHEDULERS`: Stable Diffusion), which read a diffusers
``scheduler_config.json`` dict as ``from_config`` does. Classic samplers may scale the model
input and the initial noise (Euler's ``sigma``); :func:`scale_model_input` and
:func:`init_noise_sigma` dispatch on the state type and are the identity / 1 for the flow
samplers. Stochastic ones (Euler ancestral, SDE DPM-Solver++) draw their per-step noise on the
host from one seed per batch row (:func:`jaxcore.schedulers.classic.step_noise`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxcore.schedulers import classic, ddim, dpmsolver_multistep, euler_discrete, pndm
from jaxcore.schedulers.flow_euler import (
    FlowEulerConfigError,
    FlowEulerOptions,
    FlowEulerState,
    calculate_shift,
    flow_euler_options,
    flow_euler_schedule,
    flow_euler_step,
    make_flow_euler,
    make_flow_euler_from_options,
    pipeline_sigmas,
    shift_mu,
)
from jaxcore.schedulers.unipc import UniPCState, make_unipc, unipc_step

StepFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]

# The flow-matching samplers (what SCHEDULERS always named).
SCHEDULERS: tuple[str, ...] = ("unipc", "flow_euler")
# The DDPM-trained samplers (diffusers DDIM, Euler, Euler ancestral, DPM-Solver, PNDM/PLMS).
CLASSIC_SCHEDULERS: tuple[str, ...] = (
    "ddim",
    "euler",
    "euler_ancestral",
    "dpmsolver_multistep",
    "pndm",
)
ALL_SCHEDULERS: tuple[str, ...] = SCHEDULERS + CLASSIC_SCHEDULERS


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
    shift: float | None = 1.0,
    *,
    sample_shape: Sequence[int] | None = None,
    config: Mapping[str, Any] | None = None,
    seeds: Sequence[int] | None = None,
    **options: Any,
) -> tuple[Any, StepFn]:
    """Builds the sampler ``name`` and returns ``(state, step_fn)``.

    Args:
      name: a flow-matching sampler, ``"unipc"`` (diffusers ``UniPCMultistepScheduler`` with
        flow sigmas, Wan's default) or ``"flow_euler"`` (diffusers
        ``FlowMatchEulerDiscreteScheduler``); or a classic one of :data:`CLASSIC_SCHEDULERS`
        (diffusers ``DDIMScheduler``, ``EulerDiscreteScheduler``,
        ``EulerAncestralDiscreteScheduler``, ``DPMSolverMultistepScheduler``, ``PNDMScheduler``).
      num_inference_steps: number of inference steps.
      shift: static timestep shift (``flow_shift``) of the flow samplers; the classic samplers
        have none (it must be 1 or None).
      sample_shape: latent shape (batch first); UniPC, DPM-Solver and PLMS allocate their
        history from it before a ``lax.fori_loop``; stochastic samplers draw noise of it.
      config: the classic samplers' diffusers ``scheduler_config.json`` dict, read as
        ``SchedulerClass.from_config`` reads it (keys of other schedulers are ignored, so a
        pipeline's config of any class carries its prediction type, betas, spacing, zero-SNR
        rescaling); None gives diffusers' defaults.
      seeds: one per batch row; the stochastic classic samplers (Euler ancestral,
        ``sde-dpmsolver++``) draw their per-step noise from them, deterministic per row. Ignored
        by the deterministic ones.
      **options: extra keyword arguments of :func:`make_unipc` / :func:`make_flow_euler`. For
        ``"flow_euler"`` also ``euler_options`` (a :class:`FlowEulerOptions`, e.g. Flux's, read
        by :func:`flow_euler_options`; ``shift`` replaces its ``shift``), ``sigmas`` and ``mu``
        as :func:`make_flow_euler_from_options` takes them. For ``"ddim"``: ``eta`` (> 0 draws
        noise from ``seeds``).
    """
    if name in CLASSIC_SCHEDULERS:
        if shift is not None and float(shift) != 1.0:
            raise ValueError(
                f"scheduler {name!r} takes no shift (flow_shift is a flow-matching option), "
                f"got {shift}"
            )
        return _make_classic(name, num_inference_steps, config, seeds, sample_shape, options)
    if config is not None:
        raise TypeError(f"scheduler {name!r} takes its options as keywords, not config=")
    if name == "unipc":
        state = make_unipc(num_inference_steps, shift, sample_shape=sample_shape, **options)
        return state, unipc_step
    if name == "flow_euler":
        return _make_euler(num_inference_steps, shift, **options), _euler_step
    raise ValueError(f"unknown scheduler {name!r}; expected one of {ALL_SCHEDULERS}")


def _needs_seeds(name: str, config: Mapping[str, Any] | None, options: Mapping) -> bool:
    """Whether the classic sampler ``name`` draws fresh noise every step."""
    if name == "euler_ancestral":
        return True
    if name == "ddim":
        return float(options.get("eta", 0.0)) > 0
    if name == "dpmsolver_multistep":
        algorithm = classic.as_config(dpmsolver_multistep.DPMSolverConfig, config).algorithm_type
        return algorithm == "sde-dpmsolver++"
    return False


def _make_classic(name, num_inference_steps, config, seeds, sample_shape, options):
    """The classic sampler ``name`` (see :func:`make_scheduler`)."""
    stochastic = _needs_seeds(name, config, options)
    if stochastic and seeds is None and options.get("noise") is None:
        raise ValueError(
            f"scheduler {name!r} draws fresh noise every step: pass seeds (one per batch row)"
        )
    noise = {"seeds": None if options.get("noise") is not None else seeds} if stochastic else {}
    noise.update(options)
    shape = None if sample_shape is None else tuple(sample_shape)
    if name == "ddim":
        return ddim.make_ddim(
            num_inference_steps, config, sample_shape=shape, **noise
        ), ddim.ddim_step
    if name == "euler":
        state = euler_discrete.make_euler(num_inference_steps, config, sample_shape=shape, **noise)
        return state, euler_discrete.euler_step
    if name == "euler_ancestral":
        state = euler_discrete.make_euler_ancestral(
            num_inference_steps, config, sample_shape=shape, **noise
        )
        return state, euler_discrete.euler_ancestral_step
    if name == "dpmsolver_multistep":
        state = dpmsolver_multistep.make_dpmsolver(
            num_inference_steps, config, sample_shape=shape, **noise
        )
        return state, dpmsolver_multistep.dpmsolver_step
    return pndm.make_pndm(num_inference_steps, config, sample_shape=shape, **noise), pndm.pndm_step


# state type -> (scale_model_input, init_noise_sigma or None for 1)
_INPUT_SCALING = {
    FlowEulerState: (classic.unscaled_model_input, None),
    UniPCState: (classic.unscaled_model_input, None),
    ddim.DDIMState: (ddim.scale_model_input, ddim.init_noise_sigma),
    euler_discrete.EulerState: (
        euler_discrete.scale_model_input,
        euler_discrete.init_noise_sigma,
    ),
    dpmsolver_multistep.DPMSolverState: (
        dpmsolver_multistep.scale_model_input,
        dpmsolver_multistep.init_noise_sigma,
    ),
    pndm.PNDMState: (pndm.scale_model_input, pndm.init_noise_sigma),
}


def _scaling(state):
    try:
        return _INPUT_SCALING[type(state)]
    except KeyError:
        raise TypeError(f"not a scheduler state: {type(state).__name__}") from None


def scale_model_input(state, sample: jax.Array) -> jax.Array:
    """The denoiser's input at the state's current step (diffusers' ``scale_model_input``):
    ``sample`` itself for every sampler but Euler (``sample / sqrt(sigma^2 + 1)``)."""
    return _scaling(state)[0](state, sample)


def init_noise_sigma(state) -> float | jax.Array:
    """What standard-normal initial latents are multiplied by (diffusers' ``init_noise_sigma``):
    the Python float 1.0 for the flow samplers (so their latents are left as they are), a
    float32 scalar for the classic ones (Euler's largest sigma; 1 for the others)."""
    sigma = _scaling(state)[1]
    return 1.0 if sigma is None else sigma(state)


def timesteps(state) -> jax.Array:
    """The ``[N]`` timesteps to feed the model (any scheduler state)."""
    return state.timesteps


def num_steps(state) -> int:
    """Number of model evaluations in the schedule (static)."""
    return state.timesteps.shape[0]


__all__ = [
    "ALL_SCHEDULERS",
    "CLASSIC_SCHEDULERS",
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
    "shift_mu",
    "pipeline_sigmas",
    "init_noise_sigma",
    "make_flow_euler",
    "make_flow_euler_from_options",
    "make_scheduler",
    "make_unipc",
    "num_steps",
    "scale_model_input",
    "timesteps",
    "unipc_step",
]
