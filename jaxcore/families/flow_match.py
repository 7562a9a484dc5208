"""The flow-match Euler schedule as the diffusers pipelines of the flow families set it up
(``FlowMatchEulerDiscreteScheduler``: Flux, Flux.2, LTX-Video): one place for the scheduler's
name, its config's options, the dynamic-shift check and the pipelines' sigmas."""

from __future__ import annotations

from collections.abc import Mapping

from jaxcore.family_types import FamilyError

SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"


def scheduler_name(scheduler_config: Mapping, model: str) -> str:
    """``flow_euler`` for a ``FlowMatchEulerDiscreteScheduler`` config (the default), else an
    error naming the class ``model``'s pipelines do not sample with."""
    name = scheduler_config.get("_class_name", SCHEDULER_CLASS)
    if name != SCHEDULER_CLASS:
        raise FamilyError(f"scheduler {name!r} is not supported for {model} ({SCHEDULER_CLASS})")
    return "flow_euler"


def euler_options(pipe, scheduler: str, shift, model: str, shifts_by: str = "image size"):
    """The pipeline's scheduler options (``scheduler_config.json``) for ``flow_euler``; a
    ``flow_shift`` other than the config's under dynamic shifting is refused (the schedule
    shifts by ``shifts_by`` then, the given shift would do nothing)."""
    from jaxcore.schedulers.flow_euler import FlowEulerConfigError, flow_euler_options

    if scheduler != "flow_euler":
        raise FamilyError(f"scheduler={scheduler!r}: {model} samples with flow_euler only")
    try:
        options = flow_euler_options(
            pipe.scheduler_config, f"{pipe.source}/scheduler/scheduler_config.json"
        )
    except FlowEulerConfigError as err:
        raise FamilyError(str(err)) from None
    if options.use_dynamic_shifting and float(shift) != float(options.shift):
        raise FamilyError(
            f"flow_shift={shift}: this scheduler shifts by {shifts_by} "
            "(use_dynamic_shifting), so a flow_shift has no effect; leave it unset"
        )
    return options


def config_mu(config: Mapping, sequence_length: int) -> float:
    """diffusers' ``calculate_shift`` of ``sequence_length`` tokens with the scheduler config's
    ``base_image_seq_len`` / ``max_image_seq_len`` / ``base_shift`` / ``max_shift``."""
    from jaxcore.schedulers.flow_euler import calculate_shift

    return calculate_shift(
        sequence_length,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def image_schedule(pipe, scheduler: str, num_inference_steps: int, shift, mu: float, model: str):
    """The image pipelines' schedule (FluxPipeline, Flux2KleinPipeline): sigmas
    ``linspace(1, 1/N, N)`` (or the config's ``use_flow_sigmas``), shifted by ``mu`` under
    dynamic shifting."""
    from jaxcore.schedulers import make_scheduler
    from jaxcore.schedulers.flow_euler import pipeline_sigmas

    options = euler_options(pipe, scheduler, shift, model)
    use_flow_sigmas = pipe.scheduler_config.get("use_flow_sigmas")
    sigmas = None if use_flow_sigmas else pipeline_sigmas(num_inference_steps)
    return make_scheduler(
        "flow_euler", num_inference_steps, shift, euler_options=options, sigmas=sigmas, mu=mu
    )
