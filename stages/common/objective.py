"""The training objective, shared by train (the loss) and evaluate / periodic eval (scoring).

The math lives in :mod:`jaxcore.flow_matching` (pure, tested against diffusers); this module
binds :class:`ObjectiveSection` onto it and applies it to any family's denoiser through
:meth:`jaxcore.families.Family.apply`, so train and evaluate score samples identically.
MaxDiffusion's ``sigma = (1 - t) sigma_min + t`` (a little noise left at t = 0) is kept.

Families declare their target (:attr:`Family.objective`). ``flow_matching`` (Wan, Flux) needs
nothing else. ``epsilon`` / ``v_prediction`` (the UNet families) are DDPM-trained
(:mod:`jaxcore.ddpm_objective`, diffusers' ``train_text_to_image*.py``) and need the noise
schedule the denoiser was trained with, which only the pipeline knows. That is resolved once,
outside the jitted step, into a :class:`TrainingTarget` (frozen, hashable: closed over by the
step) by :func:`training_target`, which reads it through the family's optional hook:

    ``family.noise_schedule(pipeline_dir) -> Mapping | None``

``pipeline_dir``: the diffusers pipeline directory the denoiser was loaded from, or None when it
does not come from one (a model YAML, a bare denoiser folder). It returns the pipeline's
``scheduler/scheduler_config.json`` as a dict (diffusers keys: ``num_train_timesteps``, the
betas, ``rescale_betas_zero_snr``, ``prediction_type``, ...; keys of other diffusers schedulers
are ignored), the family's default schedule for None, and None for a flow-matching family (the
hook may be absent there). The schedule's ``prediction_type`` is the target (SD 2.1 768:
``v_prediction``), whatever the family's class-level :attr:`Family.objective` says.

The target travels with a train artifact (:meth:`TrainingTarget.to_dict` /
:meth:`TrainingTarget.from_dict`) so evaluate scores with the schedule training used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

import jax
import jax.numpy as jnp

from jaxcore import ddpm_objective as ddpm
from jaxcore import flow_matching as fm
from jaxcore.schedulers import classic
from stages.common import records
from stages.common.errors import StageInputError

SIGMA_MIN = fm.MAXDIFFUSION_SIGMA_MIN
NUM_TRAIN_TIMESTEPS = 1000.0
FLOW_MATCHING = "flow_matching"
OBJECTIVES = (FLOW_MATCHING, *ddpm.KINDS)
# samplers whose logit mean follows the latent tokens per example (Family.timestep_tokens)
SHIFTED_BY_TOKENS = ("shifted_logit_normal", "stretched_logit_normal")
# ObjectiveSection keys of the DDPM objectives only (a nonzero value is refused for flow matching)
DDPM_KEYS = ("noise_offset", "snr_gamma", "input_perturbation")


@dataclasses.dataclass(frozen=True)
class ObjectiveSection:
    """The training objective's options; which apply depends on the family's target.

    Flow matching (Wan / Flux / SD3): timestep sampling and optional loss weighting.
    ``timestep_sampling``: "uniform" t~U[0,1); "logit_normal" t=sigmoid(N(logit_mean,
    logit_std)); "shifted" (MaxDiffusion's Wan trainer) t~U then t'=s*t/(1+(s-1)t) with
    s=``timestep_shift``; "shifted_logit_normal" (LTX-Video-Trainer's) logit_normal with the
    mean from the latent token count per sample (``flow_matching.shifted_logit_mean``);
    "stretched_logit_normal" (ltx-trainer's LTX-2 default) that, stretched between its
    percentiles with a tenth of the draws uniform (``flow_matching.stretched_logit_normal``).
    ``loss_weighting``: "none" or "gaussian" (a bell around
    ``weighting_center`` in timestep units, normalised over the schedule, not the batch).
    """

    timestep_sampling: Literal[
        "uniform", "logit_normal", "shifted", "shifted_logit_normal", "stretched_logit_normal"
    ] = "shifted"
    timestep_shift: float = 3.0
    logit_mean: float = 0.0
    logit_std: float = 1.0
    loss_weighting: Literal["none", "gaussian"] = "none"
    weighting_center: float = 500.0
    weighting_width: float = 250.0
    # The embedded-guidance input of families whose denoiser takes one (Flux dev), as
    # diffusers' Flux training scripts set it; families without one ignore it.
    guidance_scale: float = 3.5
    # Train only on t in [lo, hi) (the distribution above, truncated). Set by model.expert
    # for one expert of a two-expert model.
    timestep_range: tuple[float, float] = (0.0, 1.0)
    # Epsilon / v-prediction (DDPM, diffusers' train_text_to_image*.py; the keys above but
    # guidance_scale do not apply: timesteps are uniform integers). ``noise_offset``: add
    # noise_offset * N(0, 1) per sample and channel to the noise. ``snr_gamma``: min-SNR-gamma
    # loss weights (5 is the paper's); None: unweighted. ``input_perturbation``: noise the model
    # input with noise + input_perturbation * N(0, 1), the target keeping the noise.
    noise_offset: float = 0.0
    snr_gamma: float | None = None
    input_perturbation: float = 0.0

    def __post_init__(self):
        if self.timestep_shift <= 0:
            raise ValueError(f"timestep_shift must be > 0, got {self.timestep_shift}")
        if self.logit_std <= 0 or self.weighting_width <= 0:
            raise ValueError("logit_std and weighting_width must be > 0")
        object.__setattr__(self, "timestep_range", tuple(float(v) for v in self.timestep_range))
        lo, hi = self.timestep_range
        if len(self.timestep_range) != 2 or not 0.0 <= lo < hi <= 1.0:
            raise ValueError(
                f"timestep_range must be [lo, hi] with 0 <= lo < hi <= 1, got {self.timestep_range}"
            )
        if not self.noise_offset >= 0 or not self.input_perturbation >= 0:
            raise ValueError("noise_offset and input_perturbation must be >= 0")
        if self.snr_gamma is not None and not self.snr_gamma > 0:
            raise ValueError(f"snr_gamma must be > 0 (or null: no weighting), got {self.snr_gamma}")


@dataclasses.dataclass(frozen=True)
class TrainingTarget:
    """What the denoiser regresses, resolved once per run: ``kind`` (one of :data:`OBJECTIVES`)
    and, for epsilon / v-prediction, the DDPM noise schedule (static, hashable)."""

    kind: str
    schedule: classic.NoiseScheduleConfig | None = None

    def __post_init__(self):
        if self.kind not in OBJECTIVES:
            raise StageInputError(f"unknown training objective {self.kind!r}; known: {OBJECTIVES}")
        if (self.kind == FLOW_MATCHING) != (self.schedule is None):
            raise StageInputError(
                f"objective {self.kind!r}: a noise schedule goes with epsilon / v_prediction only"
            )

    @property
    def is_ddpm(self) -> bool:
        return self.schedule is not None

    def to_dict(self) -> dict:
        """What a train manifest records (``noise_schedule``: diffusers scheduler-config keys)."""
        schedule = None if self.schedule is None else dataclasses.asdict(self.schedule)
        if schedule is not None and schedule["trained_betas"] is not None:
            schedule["trained_betas"] = list(schedule["trained_betas"])
        return {"objective": self.kind, "noise_schedule": schedule}

    @classmethod
    def from_dict(cls, data: Mapping | None, where: str = "train manifest") -> TrainingTarget:
        """The target a train manifest recorded; None (artifacts from before the DDPM
        objectives) is flow matching, the only objective there was."""
        if not data:
            return FLOW_TARGET
        schedule = data.get("noise_schedule")
        if schedule is not None:
            schedule = _schedule(schedule, where)
        return cls(str(data.get("objective")), schedule)


FLOW_TARGET = TrainingTarget(FLOW_MATCHING)


def _schedule(config: Mapping, where: str) -> classic.NoiseScheduleConfig:
    try:
        return classic.read_config(classic.NoiseScheduleConfig, config, where)
    except classic.ClassicConfigError as err:
        raise StageInputError(str(err)) from None


def noise_schedule_of(family, pipeline_dir) -> Mapping | None:
    """The family's ``noise_schedule(pipeline_dir)`` hook (see the module docstring); None when
    the family has none (flow matching)."""
    hook = getattr(family, "noise_schedule", None)
    return None if hook is None else hook(pipeline_dir)


def check_options(kind: str, cfg: ObjectiveSection) -> None:
    """Refuse an option that does not apply to ``kind`` (it would be silently ignored), naming
    the key: the DDPM keys with flow matching; the flow-matching loss weighting and timestep
    range with epsilon / v-prediction."""
    if kind == FLOW_MATCHING:
        given = [key for key in DDPM_KEYS if getattr(cfg, key)]
        if given:
            raise StageInputError(
                f"objective.{given[0]}={getattr(cfg, given[0])!r} applies to epsilon / "
                "v_prediction training only; this model trains with flow matching"
            )
        return
    if cfg.loss_weighting != "none":
        raise StageInputError(
            f"objective.loss_weighting={cfg.loss_weighting!r} is flow matching's; {kind} "
            "training weights with objective.snr_gamma (min-SNR)"
        )
    if cfg.timestep_range != (0.0, 1.0):
        raise StageInputError(
            f"objective.timestep_range={list(cfg.timestep_range)} is flow matching's; {kind} "
            "training draws every DDPM timestep"
        )


def training_target(family, cfg: ObjectiveSection, pipeline_dir=None) -> TrainingTarget:
    """The run's :class:`TrainingTarget`: the family's objective, and for epsilon /
    v-prediction the noise schedule of ``pipeline_dir`` (through ``family.noise_schedule``),
    whose ``prediction_type`` decides between the two. ``cfg`` is checked against it."""
    check_objective(family)
    if family.objective == FLOW_MATCHING:
        check_options(FLOW_MATCHING, cfg)
        return FLOW_TARGET
    config = noise_schedule_of(family, pipeline_dir)
    if config is None:
        raise StageInputError(
            f"the {family.name} family trains with {family.objective!r}, which needs the noise "
            f"schedule of its pipeline, but it gives none (family.noise_schedule({pipeline_dir!r}))"
        )
    where = f"{pipeline_dir}/scheduler/scheduler_config.json" if pipeline_dir else "noise schedule"
    schedule = _schedule(config, where)
    if schedule.prediction_type not in ddpm.KINDS:
        raise StageInputError(
            f"{where}: prediction_type={schedule.prediction_type!r} cannot be trained; "
            f"implemented: {ddpm.KINDS}"
        )
    check_options(schedule.prediction_type, cfg)
    return TrainingTarget(schedule.prediction_type, schedule)


def _target_or_flow(family, target: TrainingTarget | None) -> TrainingTarget:
    """``target``, or flow matching when none is given and the family trains with it; a DDPM
    family without one is refused (its schedule cannot be guessed)."""
    if target is not None:
        return target
    check_objective(family)
    if family.objective != FLOW_MATCHING:
        raise StageInputError(
            f"the {family.name} family trains with {family.objective!r}: the loss needs its "
            "noise schedule, objective.training_target(family, cfg, pipeline_dir)"
        )
    return FLOW_TARGET


def check_objective(family) -> None:
    """Refuse a family whose training target is not implemented here (names both)."""
    objective = getattr(family, "objective", None)
    if objective not in OBJECTIVES:
        raise StageInputError(
            f"the {family.name} family trains with {objective!r}; implemented: {OBJECTIVES}"
        )


def sample_t(key: jax.Array, batch: int, cfg: ObjectiveSection, tokens: int = 0) -> jax.Array:
    """Training times t in [0, 1), one per sample, by ``cfg.timestep_sampling`` (``tokens``:
    the latent tokens per sample, which ``shifted_logit_normal`` takes its mean from)."""
    mean = cfg.logit_mean
    if cfg.timestep_sampling in SHIFTED_BY_TOKENS:
        mean = fm.shifted_logit_mean(tokens)
    return fm.sample_timesteps(
        key,
        batch,
        cfg.timestep_sampling,
        shift=cfg.timestep_shift,
        logit_mean=mean,
        logit_std=cfg.logit_std,
        t_range=cfg.timestep_range,
    )


def noisy_input(x0: jax.Array, noise: jax.Array, t: jax.Array, sigma_min=SIGMA_MIN) -> jax.Array:
    """``x_t`` at times ``t`` (MaxDiffusion's sigma_min variant unless ``sigma_min`` says)."""
    return fm.add_noise(x0, noise, t, sigma_min=sigma_min).astype(x0.dtype)


velocity_target = fm.velocity_target


def loss_weight(t: jax.Array, cfg: ObjectiveSection) -> jax.Array:
    """Per-sample weight, a fixed function of t normalised over the schedule (never the batch).

    The config gives the bell in timestep units (centre, width); ``flow_matching`` takes it in
    t units as ``exp(-sharpness (t - centre)^2)``.
    """
    width = cfg.weighting_width / NUM_TRAIN_TIMESTEPS
    return fm.loss_weights(
        t,
        cfg.loss_weighting,
        center=cfg.weighting_center / NUM_TRAIN_TIMESTEPS,
        sharpness=0.5 / width**2,
    )


def per_sample_loss(prediction: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error over every axis but the batch, in float32."""
    return fm.flow_matching_loss(prediction, target)[1]


def embedded_inputs(family, denoiser_config, cfg: ObjectiveSection) -> dict[str, float]:
    """The per-sample scalar inputs the family's denoiser takes besides the records (Flux dev:
    ``guidance``), at the values training uses; recorded in the train manifest so evaluate
    scores with the same ones."""
    configs = {family.denoiser_component: denoiser_config}
    return dict(
        family.guidance(configs, guidance_scale=cfg.guidance_scale, true_cfg_scale=1.0).embedded
    )


def split_batch(
    batch: Mapping[str, jax.Array], embedded: Mapping[str, float] | None = None
) -> tuple[jax.Array, dict]:
    """(latents as float32, the conditioning tensors) of a batch of records, with the embedded
    inputs as ``[B]`` arrays."""
    latents = batch[records.LATENTS].astype(jnp.float32)
    conditioning = {k: v for k, v in batch.items() if k != records.LATENTS}
    for name, value in (embedded or {}).items():
        conditioning[name] = jnp.full((latents.shape[0],), value, jnp.float32)
    return latents, conditioning


def loss_at(family, module, params, latents, conditioning, t, noise) -> jax.Array:
    """Per-sample flow-matching MSE of ``latents`` at times ``t`` [B] with ``noise``, over the
    elements the family's :meth:`~jaxcore.families.Family.loss_mask` counts (all by default),
    or the family's :meth:`~jaxcore.families.Family.loss_weights` sum where it gives one."""
    sigma_min = getattr(family, "training_sigma_min", SIGMA_MIN)  # optional, as loss_mask
    x_t = noisy_input(latents, noise, t, sigma_min)
    prediction = family.apply(module, params, x_t, t * NUM_TRAIN_TIMESTEPS, conditioning)
    target = velocity_target(latents, noise)
    loss_weights = getattr(family, "loss_weights", None)  # optional, as loss_mask
    weights = None if loss_weights is None else loss_weights(latents.shape, conditioning)
    if weights is not None:  # the family's own weighted sum (LTX-2: video mean + audio mean)
        error = (prediction.astype(jnp.float32) - target.astype(jnp.float32)) ** 2
        weights = jnp.broadcast_to(jnp.asarray(weights, jnp.float32), error.shape)
        return jnp.sum(error * weights, axis=tuple(range(1, error.ndim)))
    loss_mask = getattr(family, "loss_mask", None)  # optional, as noise_schedule
    mask = None if loss_mask is None else loss_mask(latents.shape, conditioning)
    if mask is None:
        return per_sample_loss(prediction, target)
    error = (prediction.astype(jnp.float32) - target.astype(jnp.float32)) ** 2
    mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), error.shape)
    axes = tuple(range(1, error.ndim))
    return jnp.sum(error * mask, axis=axes) / jnp.sum(mask, axis=axes)


def ddpm_loss_at(
    family,
    module,
    params,
    latents,
    conditioning,
    timesteps,
    noise,
    target: TrainingTarget,
    input_noise=None,
) -> jax.Array:
    """Per-sample epsilon / v MSE of ``latents`` at integer DDPM ``timesteps`` [B].

    ``input_noise`` (input perturbation) builds the model input instead of ``noise``; the
    target is always built from ``noise``, as diffusers' scripts do.
    """
    schedule = target.schedule
    model_noise = noise if input_noise is None else input_noise
    x_t = ddpm.add_noise(schedule, latents, model_noise, timesteps)
    # the UNet takes the integer timestep itself (diffusers passes the long tensor)
    prediction = family.apply(module, params, x_t, timesteps.astype(jnp.float32), conditioning)
    wanted = ddpm.target(target.kind, schedule, latents, noise, timesteps)
    return per_sample_loss(prediction, wanted)


def eval_loss_at(
    family, module, params, latents, conditioning, timesteps, noise, target=None
) -> jax.Array:
    """Per-sample loss at the records' fixed ``timesteps`` [B] (0..1000 scale), unweighted.

    Flow matching: at ``t = timesteps / 1000``. Epsilon / v: at the integer DDPM timestep
    ``clip(round(timesteps), 0, T - 1)`` (:func:`jaxcore.ddpm_objective.eval_timesteps`; 1000
    scores at 999), with plain noise: the training-only noise offset, input perturbation and
    min-SNR weights are not part of the yardstick.
    """
    target = _target_or_flow(family, target)
    if not target.is_ddpm:
        t = timesteps.astype(jnp.float32) / NUM_TRAIN_TIMESTEPS
        return loss_at(family, module, params, latents, conditioning, t, noise)
    steps = ddpm.eval_timesteps(timesteps, target.schedule.num_train_timesteps)
    return ddpm_loss_at(family, module, params, latents, conditioning, steps, noise, target)


def training_loss(
    family, module, params, batch, key, cfg: ObjectiveSection, embedded=None, target=None
) -> jax.Array:
    """Mean weighted loss of one batch, with timesteps and noise drawn from ``key``.

    ``target``: the run's :class:`TrainingTarget` (static); None means flow matching, and is
    refused for a family that trains with epsilon / v-prediction.
    """
    per_sample = weighted_losses(family, module, params, batch, key, cfg, embedded, target)
    return jnp.mean(per_sample)


def prior_preservation_loss(
    per_sample: jax.Array, prior_rows: int, prior_loss_weight: float
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DreamBooth's loss of a batch whose last ``prior_rows`` rows are class (prior) examples:
    ``mean(instance rows) + prior_loss_weight * mean(prior rows)``, as diffusers'
    train_dreambooth*.py chunk the batch (instance first); with the parts as metrics."""
    instance, prior = per_sample[:-prior_rows], per_sample[-prior_rows:]
    parts = {"instance_loss": jnp.mean(instance), "prior_loss": jnp.mean(prior)}
    return parts["instance_loss"] + prior_loss_weight * parts["prior_loss"], parts


def weighted_losses(
    family, module, params, batch, key, cfg: ObjectiveSection, embedded=None, target=None
) -> jax.Array:
    """Per-sample weighted losses ``[B]`` of one batch (their mean is :func:`training_loss`),
    with timesteps and noise drawn from ``key`` for the whole batch."""
    target = _target_or_flow(family, target)
    check_options(target.kind, cfg)  # at trace time
    latents, conditioning = split_batch(batch, embedded)
    if target.is_ddpm:
        return _ddpm_weighted_losses(
            family, module, params, latents, conditioning, key, cfg, target
        )
    key_t, key_noise = jax.random.split(key)
    tokens = 0
    if cfg.timestep_sampling in SHIFTED_BY_TOKENS:
        tokens = family.timestep_tokens(module.config, latents.shape[1:])
    t = sample_t(key_t, latents.shape[0], cfg, tokens)
    noise = jax.random.normal(key_noise, latents.shape, jnp.float32)
    per_sample = loss_at(family, module, params, latents, conditioning, t, noise)
    return per_sample * loss_weight(t, cfg)


def _ddpm_weighted_losses(
    family, module, params, latents, conditioning, key, cfg: ObjectiveSection, target
) -> jax.Array:
    """diffusers' train_text_to_image*.py step per sample: uniform integer timesteps, offset
    noise, input perturbation, epsilon / v target, optional min-SNR-gamma weights."""
    key_t, key_noise, key_offset, key_perturb = jax.random.split(key, 4)
    schedule = target.schedule
    timesteps = ddpm.sample_timesteps(key_t, latents.shape[0], schedule.num_train_timesteps)
    noise = jax.random.normal(key_noise, latents.shape, jnp.float32)
    if cfg.noise_offset:
        noise = ddpm.offset_noise(key_offset, noise, cfg.noise_offset)
    input_noise = None
    if cfg.input_perturbation:
        input_noise = ddpm.perturb_noise(key_perturb, noise, cfg.input_perturbation)
    per_sample = ddpm_loss_at(
        family, module, params, latents, conditioning, timesteps, noise, target, input_noise
    )
    if cfg.snr_gamma is not None:
        snr = ddpm.snr(schedule, timesteps)
        per_sample = per_sample * ddpm.min_snr_weights(snr, cfg.snr_gamma, target.kind)
    return per_sample
