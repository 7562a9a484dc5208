"""Shared pieces of the classic (DDPM-trained, discrete-timestep) samplers.

The samplers in :mod:`~jaxcore.schedulers.ddim`, :mod:`~jaxcore.schedulers.euler_discrete`,
:mod:`~jaxcore.schedulers.dpmsolver_multistep` and :mod:`~jaxcore.schedulers.pndm` follow
diffusers' ``DDIMScheduler``, ``EulerDiscreteScheduler``, ``EulerAncestralDiscreteScheduler``,
``DPMSolverMultistepScheduler`` and ``PNDMScheduler``. What they share lives here (the
flow-matching Euler sampler reuses the config-field checks and the sigma respacings):

* the configuration: :class:`NoiseScheduleConfig` (the DDPM noise schedule every one of them
  reads) which each sampler's config extends, and :func:`read_config`, which reads a diffusers
  ``scheduler_config.json`` dict the way diffusers' ``from_config`` does (keys of *other*
  diffusers schedulers are ignored, so SD 2's PNDM/DDIM config builds an Euler sampler), while
  an unknown key or a value we do not reproduce is a :class:`ClassicConfigError`;
* the host-side schedule: betas (``linear``, ``scaled_linear``, ``squaredcos_cap_v2``, or
  ``trained_betas``), zero-terminal-SNR rescaling (Lin et al., arXiv 2305.08891, Alg. 1),
  ``alphas_cumprod``, timestep spacing (ibid., Table 2), Karras (Karras et al., arXiv
  2206.00364, eq. 5), exponential and beta (Lee et al., arXiv 2407.12173) sigmas and the
  sigma -> timestep interpolation;
* the training objective's :func:`add_noise` and :func:`velocity` (diffusers
  ``DDPMScheduler.add_noise`` / ``get_velocity``), pure and jittable;
* :func:`step_noise`, the per-step noise of the stochastic samplers, drawn on the host per prompt.

Numerics. Schedules are computed once on the host in numpy and reproduce diffusers' float32
arithmetic: PyTorch's CPU ``linspace`` (a fused multiply-add from the nearer end), ``cumprod``
(accumulated in float64), and elementwise float32 ops in diffusers' order. PyTorch's float32
``sqrt``/``log``/``exp`` (MKL on x86) are within an ulp of the correctly rounded values we use
(computed in float64, rounded once; numpy's own float32 ``log``/``exp`` are further off), so
betas and ``alphas_cumprod`` are bit-exact (except with zero-SNR rescaling, which takes square
roots) and sigmas agree to an ulp or two. The per-step scalar coefficients of every sampler are
precomputed the same way, so a step only multiplies and adds tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")

# The smallest alphas_cumprod Euler and DPM-Solver keep at the last training step under
# zero-terminal-SNR rescaling (diffusers sets it so the largest sigma, 4096, stays finite).
ZERO_SNR_ALPHA_CUMPROD = 2.0**-24

# Every config key of every diffusers scheduler (diffusers 0.42). A key of another scheduler is
# ignored, as diffusers' ``from_config`` ignores it; any other key is reported as unknown.
# tests/jaxcore/test_classic_schedulers.py checks this list against the installed diffusers.
DIFFUSERS_SCHEDULER_KEYS = frozenset(
    """
    algorithm_type alpha_cum_end alpha_cum_start base_image_seq_len base_shift beta_end
    beta_schedule beta_start block_length clip_denoised clip_sample clip_sample_range
    correct_steps corrector_k corrector_order corrector_selection corrector_selection_tau
    corrector_steps disable_corrector dynamic_thresholding_ratio editing_threshold entropy_bound
    eps eta euler_at_final final_sigmas_type final_step_size_scale flow_shift gamma
    gamma_cum_end gamma_cum_start interpolation_type invert_sigmas lambda_min_clipped
    lower_order_final mask_token_id masking_schedule max_image_seq_len max_shift minimal_topk
    n_grid noise_mode num_inference_steps num_policy_substeps num_train_timesteps
    num_vec_classes original_inference_steps predict_x0 prediction_type predictor_order
    rescale_betas_zero_snr rho s s_churn s_max s_min s_noise sample_max_value sampling_eps
    scale_factors scaler schedule_mode scheduler_type set_alpha_to_one shift shift_terminal
    sigma_data sigma_max sigma_min sigma_schedule skip_prk_steps snr snr_shift_scale
    solver_order solver_p solver_type stage_range stages steps_offset stochastic_sampling
    t_lim_ode t_lim_ode_below t_max t_min tail_step_multiplier tail_steps tau_func threshold
    thresholding time_shift_type timestep_scaling timestep_spacing timestep_type trained_betas
    tsr_k tsr_sigma upscale_mode use_beta_sigmas use_dynamic_shifting use_exponential_sigmas
    use_flow_sigmas use_karras_sigmas use_lu_lambdas variance_type
    """.split()  # noqa: SIM905 (a word list reads better as text)
)


class ClassicConfigError(ValueError):
    """A scheduler configuration we refuse: malformed, unknown, or not reproduced exactly."""


# ---------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class NoiseScheduleConfig:
    """The DDPM noise schedule every classic sampler reads (diffusers names and defaults).

    Fields:
      num_train_timesteps: ``T``, the number of training timesteps.
      beta_start, beta_end, beta_schedule: the betas, ``linear``, ``scaled_linear`` (linear in
        ``sqrt(beta)``, SD) or ``squaredcos_cap_v2`` (the cosine schedule, capped at 0.999).
      trained_betas: explicit betas (``T`` of them) instead; ``beta_*`` are then ignored.
      rescale_betas_zero_snr: rescale so the last training step has zero SNR.
      prediction_type: what the model predicts, ``epsilon``, ``v_prediction`` or ``sample``.
      timestep_spacing: ``leading``, ``trailing`` or ``linspace`` (each sampler's default).
      steps_offset: added to ``leading`` timesteps (SD: 1).
    """

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    rescale_betas_zero_snr: bool = False
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0

    # What the sampler accepts (a class attribute, not a field: it has no annotation).
    _prediction_types = PREDICTION_TYPES

    def __post_init__(self):
        normalise_fields(self, ClassicConfigError, null_flags_are_false=True)
        if self.num_train_timesteps < 1:
            raise ClassicConfigError(
                f"num_train_timesteps={self.num_train_timesteps}: must be >= 1"
            )
        if self.trained_betas is None:
            check_choice("beta_schedule", self.beta_schedule, BETA_SCHEDULES)
        elif len(self.trained_betas) != self.num_train_timesteps:
            raise ClassicConfigError(
                f"trained_betas has {len(self.trained_betas)} values for "
                f"num_train_timesteps={self.num_train_timesteps}"
            )
        check_choice("prediction_type", self.prediction_type, self._prediction_types)
        check_choice("timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        self._validate()

    def _validate(self) -> None:
        """Checks of the subclass's own fields (raise :class:`ClassicConfigError`)."""


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    """Raises :class:`ClassicConfigError` naming ``name`` unless ``value`` is in ``choices``."""
    if value not in choices:
        raise ClassicConfigError(f"{name}={value!r} is not supported; expected one of {choices}")


def normalise_fields(config: Any, error: type[ValueError], *, null_flags_are_false: bool) -> None:
    """Checks every field of the frozen dataclass ``config`` against its annotation (JSON
    types) and stores the normalised value; a mismatch raises ``error`` naming the field.

    ``null_flags_are_false``: a null boolean reads as false (diffusers only tests the classic
    samplers' flags for truthiness, and types some of them ``bool | None``); otherwise it is
    refused. The flow-matching Euler options are checked here too, refusing null flags.
    """
    # field.type is the annotation string (the dataclass's module has
    # ``from __future__ import annotations``).
    for field in dataclasses.fields(config):
        value = _normalised(
            field.name, field.type, getattr(config, field.name), error, null_flags_are_false
        )
        object.__setattr__(config, field.name, value)


def _normalised(
    name: str, annotation: str, value: Any, error: type[ValueError], null_flags_are_false: bool
) -> Any:
    """``value`` of field ``name`` checked against its annotation, normalised."""
    optional = annotation.endswith(" | None")
    kind = annotation.removesuffix(" | None")
    if value is None and optional:
        return None
    if kind == "bool" and value is None and null_flags_are_false:
        return False
    if kind == "bool" and isinstance(value, bool | np.bool_):
        return bool(value)
    if not isinstance(value, bool | np.bool_):
        if kind == "int" and isinstance(value, numbers.Integral):
            return int(value)
        if kind == "float" and isinstance(value, numbers.Real):
            return float(value)
        if kind == "str" and isinstance(value, str):
            return value
        if kind == "tuple[float, ...]" and _is_real_sequence(value):
            return tuple(float(v) for v in np.asarray(value, np.float64).ravel())
    expected = f"{kind} or null" if optional else kind
    raise error(f"{name}={value!r}: expected {expected}")


def _is_real_sequence(value: Any) -> bool:
    if isinstance(value, str | bytes):
        return False
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        return False
    return array.ndim == 1 and array.dtype.kind in "iuf"


def read_config(cls: type, config: Mapping[str, Any], where: str = "scheduler config"):
    """An instance of the config dataclass ``cls`` from a diffusers ``scheduler_config.json``.

    As diffusers' ``SchedulerClass.from_config(config)``: keys starting with ``_`` are metadata,
    keys listed in ``_use_default_values`` (filled in by diffusers from another class's
    defaults) take ``cls``'s defaults instead, and keys of other diffusers schedulers are
    ignored. Any other key, a wrong type, or a value we do not reproduce raises
    :class:`ClassicConfigError` naming the key and ``where``. A flow-matching scheduler's config
    (``_class_name`` ``Flow...``) is refused outright: it describes another kind of model.
    """
    class_name = config.get("_class_name")
    if isinstance(class_name, str) and class_name.startswith("Flow"):
        raise ClassicConfigError(
            f"{where}: _class_name={class_name!r} is a flow-matching scheduler; a DDPM-trained "
            f"sampler ({cls.__name__}) cannot sample that model"
        )
    known = {field.name for field in dataclasses.fields(cls)}
    defaulted = set(config.get("_use_default_values") or ())
    kwargs, unknown = {}, []
    for key, value in config.items():
        if key.startswith("_") or key in defaulted:
            continue
        if key in known:
            kwargs[key] = value
        elif key not in DIFFUSERS_SCHEDULER_KEYS:
            unknown.append(key)
    if unknown:
        raise ClassicConfigError(
            f"{where}: unknown keys {sorted(unknown)} (neither {cls.__name__} fields nor keys of "
            f"any diffusers scheduler)"
        )
    try:
        return cls(**kwargs)
    except ClassicConfigError as error:
        raise ClassicConfigError(f"{where}: {error}") from None


def as_config(cls: type, config: Any):
    """``config`` as a ``cls``: ``None`` gives the defaults, a mapping is read with
    :func:`read_config`, an instance of ``cls`` is returned as is."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, Mapping):
        return read_config(cls, config)
    raise TypeError(f"expected a {cls.__name__}, a config dict or None, got {type(config)}")


# ---------------------------------------------------------------- torch float32 arithmetic

f32 = np.float32


def torch_linspace(start: float, end: float, steps: int) -> np.ndarray:
    """``torch.linspace(start, end, steps, dtype=float32)`` on CPU, bit for bit.

    PyTorch rounds the ends and the step to float32 and computes each value as one fused
    multiply-add from the nearer end: ``start + step * i`` for the first half, ``end - step *
    (steps - 1 - i)`` for the second. The fma is exact in float64 (24-bit products) and rounded
    once to float32.
    """
    if steps == 1:
        return np.full(1, start, f32)
    start32, end32 = f32(start), f32(end)
    step = (end32 - start32) / f32(steps - 1)
    index = np.arange(steps)
    from_start = np.float64(step) * index + np.float64(start32)
    from_end = np.float64(end32) - np.float64(step) * (steps - 1 - index)
    return np.where(index < steps // 2, from_start, from_end).astype(f32)


def log32(x) -> np.ndarray:
    """Correctly rounded float32 ``log`` (as PyTorch's CPU kernel; numpy's float32 differs)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(np.asarray(x, np.float64)).astype(f32)


def exp32(x) -> np.ndarray:
    """Correctly rounded float32 ``exp`` (as PyTorch's CPU kernel; numpy's float32 differs)."""
    with np.errstate(over="ignore"):
        return np.exp(np.asarray(x, np.float64)).astype(f32)


# ---------------------------------------------------------------- the noise schedule


def _cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> np.ndarray:
    """Betas of the ``squaredcos_cap_v2`` schedule (Nichol & Dhariwal, arXiv 2102.09672):
    ``1 - abar(t+1)/abar(t)`` with ``abar(t) = cos^2((t/T + 0.008)/1.008 * pi/2)``, capped, in
    Python floats and rounded once to float32."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = []
    for i in range(num_train_timesteps):
        ratio = alpha_bar((i + 1) / num_train_timesteps) / alpha_bar(i / num_train_timesteps)
        betas.append(min(1 - ratio, max_beta))
    return np.asarray(betas, f32)


def _cumprod(alphas: np.ndarray) -> np.ndarray:
    """float32 cumulative product accumulated in float64, as PyTorch's CPU ``cumprod``."""
    return np.cumprod(alphas.astype(np.float64)).astype(f32)


def rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Betas whose last step has zero SNR (Lin et al. 2023, Algorithm 1), in float32.

    Shifts ``sqrt(alphas_cumprod)`` so its last value is 0 and scales it so the first is
    unchanged, then undoes the cumulative product.
    """
    root = np.sqrt(_cumprod(f32(1.0) - betas))
    first, last = root[0], root[-1]
    root = (root - last) * (first / (first - last))
    alpha_bar = root * root
    alphas = np.concatenate([alpha_bar[:1], alpha_bar[1:] / alpha_bar[:-1]])
    return f32(1.0) - alphas


@functools.lru_cache(maxsize=64)
def _betas(config: NoiseScheduleConfig) -> np.ndarray:
    if config.trained_betas is not None:
        betas = np.asarray(config.trained_betas, f32)
    elif config.beta_schedule == "linear":
        betas = torch_linspace(config.beta_start, config.beta_end, config.num_train_timesteps)
    elif config.beta_schedule == "scaled_linear":
        root = torch_linspace(
            config.beta_start**0.5, config.beta_end**0.5, config.num_train_timesteps
        )
        betas = root * root
    else:
        betas = _cosine_betas(config.num_train_timesteps)
    if config.rescale_betas_zero_snr:
        betas = rescale_zero_terminal_snr(betas)
    betas.flags.writeable = False
    return betas


def betas(config: NoiseScheduleConfig) -> np.ndarray:
    """The ``[T]`` float32 training betas (after zero-SNR rescaling if configured)."""
    return _betas(config).copy()


def alphas_cumprod(config: NoiseScheduleConfig, *, zero_snr_floor: bool = False) -> np.ndarray:
    """``[T]`` float32 ``alpha_bar_t = prod_{s <= t} (1 - beta_s)``.

    ``zero_snr_floor``: with zero-SNR rescaling the last value is 0; Euler and DPM-Solver then
    use ``2**-24`` (so their largest sigma is finite), DDIM and DDPM keep 0.
    """
    cumprod = _cumprod(f32(1.0) - _betas(config))
    if zero_snr_floor and config.rescale_betas_zero_snr:
        cumprod[-1] = ZERO_SNR_ALPHA_CUMPROD
    return cumprod


def train_sigmas(alpha_bar: np.ndarray) -> np.ndarray:
    """``[T]`` float32 sigmas ``sqrt((1 - alpha_bar) / alpha_bar)`` (noise-to-signal), one per
    training timestep, increasing."""
    with np.errstate(divide="ignore"):
        return np.sqrt((f32(1.0) - alpha_bar) / alpha_bar)


def spaced_timesteps(
    config: NoiseScheduleConfig, num_inference_steps: int, *, round_linspace: bool
) -> np.ndarray:
    """The decreasing inference timesteps (float64) of DDIM, PNDM and Euler's ``set_timesteps``
    with ``config``'s ``timestep_spacing``, ``num_train_timesteps`` ``T`` and ``steps_offset``.

    ``leading``: multiples of ``T // N`` from 0, plus ``steps_offset``. ``trailing``: ``T - 1``
    down in steps of ``T / N``, rounded (diffusers' ``arange`` with a float step can give one
    timestep more, e.g. 62 for N=61, ending at -1; reproduced). ``linspace``: ``N`` points over
    ``[0, T - 1]``, rounded to integers for DDIM (``round_linspace``) and kept fractional (float32)
    for Euler.
    """
    spacing, num_train_timesteps = config.timestep_spacing, config.num_train_timesteps
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if spacing == "linspace":
        points = np.linspace(0, num_train_timesteps - 1, num_inference_steps)
        points = points.round() if round_linspace else points.astype(f32).astype(np.float64)
        return points[::-1].copy()
    if spacing == "leading":
        ratio = num_train_timesteps // num_inference_steps
        return (np.arange(num_inference_steps) * ratio).round()[::-1] + config.steps_offset
    ratio = num_train_timesteps / num_inference_steps
    return np.round(np.arange(num_train_timesteps, 0, -ratio)) - 1


def previous_alpha_bar(
    alpha_bar: np.ndarray, previous: np.ndarray, set_alpha_to_one: bool
) -> np.ndarray:
    """``abar`` at each ``previous`` timestep (DDIM's and PLMS's step target); a negative one,
    before the first training step, reads 1 with ``set_alpha_to_one``, else ``abar_0``
    (diffusers' ``final_alpha_cumprod``)."""
    final = f32(1.0) if set_alpha_to_one else alpha_bar[0]
    return np.where(previous >= 0, alpha_bar[np.maximum(previous, 0)], final)


def sigma_to_timestep(sigmas: np.ndarray, log_train_sigmas: np.ndarray) -> np.ndarray:
    """The fractional training timestep of each sigma (float64): linear interpolation of the
    index in the table of ``log`` training sigmas, clamped to ``[0, T - 1]``.

    ``log_train_sigmas`` must be what diffusers uses, ``np.log`` of the float32 sigmas.
    """
    log_sigma = np.log(np.maximum(np.asarray(sigmas, np.float64), 1e-10))
    above = log_sigma[None, :] - log_train_sigmas[:, None] >= 0
    # The last table entry at or below log_sigma (the table increases), kept off the end.
    low = np.cumsum(above, axis=0).argmax(axis=0).clip(max=len(log_train_sigmas) - 2)
    low_value, high_value = log_train_sigmas[low], log_train_sigmas[low + 1]
    weight = np.clip((low_value - log_sigma) / (low_value - high_value), 0, 1)
    return (1 - weight) * low + weight * (low + 1)


def karras_sigmas(sigma_max: float, sigma_min: float, num_steps: int, rho: float = 7.0):
    """``num_steps`` float64 sigmas from ``sigma_max`` to ``sigma_min``, linear in
    ``sigma^(1/rho)`` (Karras et al. 2022, eq. 5)."""
    max_root, min_root = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    ramp = np.linspace(0, 1, num_steps)
    return (max_root + ramp * (min_root - max_root)) ** rho


def exponential_sigmas(sigma_max: float, sigma_min: float, num_steps: int) -> np.ndarray:
    """``num_steps`` float64 sigmas from ``sigma_max`` to ``sigma_min``, linear in ``log``."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), num_steps))


def beta_sigmas(
    sigma_max: float, sigma_min: float, num_steps: int, alpha: float = 0.6, beta: float = 0.6
) -> np.ndarray:
    """``num_steps`` float64 sigmas from ``sigma_max`` to ``sigma_min`` at the quantiles of a
    Beta(alpha, beta) distribution (Lee et al. 2024). Needs scipy (a jax dependency)."""
    import scipy.stats  # imported here: only this option needs it

    quantiles = scipy.stats.beta.ppf(1 - np.linspace(0, 1, num_steps), alpha, beta)
    return np.array([sigma_min + q * (sigma_max - sigma_min) for q in quantiles])


def respaced_sigmas(
    kind: str, sigma_max: float, sigma_min: float, num_steps: int
) -> np.ndarray | None:
    """The ``kind`` (``karras``, ``exponential``, ``beta``) respacing, or ``None`` for none."""
    if kind == "karras":
        return karras_sigmas(sigma_max, sigma_min, num_steps)
    if kind == "exponential":
        return exponential_sigmas(sigma_max, sigma_min, num_steps)
    if kind == "beta":
        return beta_sigmas(sigma_max, sigma_min, num_steps)
    return None


def sigma_spacing(config: Any) -> str | None:
    """Which of ``use_karras_sigmas``/``use_exponential_sigmas``/``use_beta_sigmas`` is on."""
    for kind in ("karras", "exponential", "beta"):
        if getattr(config, f"use_{kind}_sigmas"):
            return kind
    return None


def check_one_sigma_spacing(config: Any, error: type[ValueError] = ClassicConfigError) -> None:
    """At most one of the Karras / exponential / beta respacings may be on (as diffusers);
    raises ``error`` naming them otherwise."""
    chosen = [f"use_{kind}_sigmas" for kind in ("karras", "exponential", "beta")]
    chosen = [name for name in chosen if getattr(config, name)]
    if len(chosen) > 1:
        raise error(f"{' and '.join(chosen)} are all true; at most one may be")


# ---------------------------------------------------------------- stepping, model input, initial noise


def float32_step_inputs(model_output: jax.Array, sample: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(model_output, sample)`` in float32, in which every classic step computes (diffusers
    upcasts the sample), once they are checked to have one shape."""
    if model_output.shape != sample.shape:
        raise ValueError(f"model_output shape {model_output.shape} != sample shape {sample.shape}")
    return model_output.astype(jnp.float32), sample.astype(jnp.float32)


def unscaled_model_input(state: Any, sample: jax.Array) -> jax.Array:
    """``scale_model_input`` of every sampler but Euler: the model sees the sample itself."""
    del state
    return sample


def unit_noise_sigma(state: Any) -> jax.Array:
    """``init_noise_sigma`` of DDIM, DPM-Solver and PLMS: 1 (the latents start as standard
    normal), a float32 scalar."""
    del state
    return jnp.ones((), jnp.float32)


# ---------------------------------------------------------------- training objective


def _per_sample(values: jax.Array, ndim: int) -> jax.Array:
    """``[B]`` -> ``[B, 1, ...]`` broadcastable against a ``ndim``-dim batch."""
    values = values.reshape(-1)
    return values.reshape(values.shape + (1,) * (ndim - 1))


def _signal_noise_scales(config: NoiseScheduleConfig, timesteps: jax.Array, ndim: int, dtype):
    """``(sqrt(alpha_bar_t), sqrt(1 - alpha_bar_t))`` per sample, in ``dtype``."""
    table = jnp.asarray(alphas_cumprod(config)).astype(dtype)
    alpha_bar = _per_sample(table[jnp.asarray(timesteps)], ndim)
    return jnp.sqrt(alpha_bar), jnp.sqrt(1 - alpha_bar)


def add_noise(
    config: NoiseScheduleConfig, clean: jax.Array, noise: jax.Array, timesteps: jax.Array
) -> jax.Array:
    """The forward process ``sqrt(alpha_bar_t) x0 + sqrt(1 - alpha_bar_t) eps`` (diffusers
    ``DDPMScheduler.add_noise``); ``timesteps`` are ``[B]`` integers in ``[0, T)``. Pure and
    jittable (``config`` is static); computed in ``clean``'s dtype, as diffusers does."""
    signal, noise_scale = _signal_noise_scales(config, timesteps, clean.ndim, clean.dtype)
    return signal * clean + noise_scale * noise


def velocity(
    config: NoiseScheduleConfig, clean: jax.Array, noise: jax.Array, timesteps: jax.Array
) -> jax.Array:
    """The v-prediction target ``sqrt(alpha_bar_t) eps - sqrt(1 - alpha_bar_t) x0`` (diffusers
    ``DDPMScheduler.get_velocity``; Salimans & Ho, arXiv 2202.00512). Pure and jittable."""
    signal, noise_scale = _signal_noise_scales(config, timesteps, clean.ndim, clean.dtype)
    return signal * noise - noise_scale * clean


# ---------------------------------------------------------------- stochastic samplers' noise

# The PCG64 stream of step noise is seeded with (seed, STEP_NOISE_STREAM), so it is independent
# of the initial latents, which sampling.initial_latents draws from PCG64(seed).
STEP_NOISE_STREAM = 1


def step_noise(seeds: Sequence[int], num_steps: int, per_sample_shape: Sequence[int]) -> np.ndarray:
    """``[num_steps, B, *per_sample_shape]`` float32 standard-normal noise, one slice per step.

    Sample ``b`` depends on ``seeds[b]`` alone (numpy PCG64 on the host, the same numbers on
    every machine and batch layout, as :func:`jaxcore.sampling.initial_latents`).
    """
    per_prompt = []
    for seed in seeds:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        generator = np.random.Generator(np.random.PCG64([int(seed), STEP_NOISE_STREAM]))
        per_prompt.append(generator.standard_normal((num_steps, *per_sample_shape), f32))
    return np.stack(per_prompt, axis=1)


def checked_noise(
    noise: Any, seeds: Sequence[int] | None, num_steps: int, sample_shape: Sequence[int] | None
) -> jax.Array:
    """The ``[num_steps, *sample_shape]`` float32 per-step noise of a stochastic sampler: the
    given ``noise``, or :func:`step_noise` of ``seeds`` (one per batch element)."""
    if (noise is None) == (seeds is None):
        raise ValueError("give exactly one of noise ([num_steps, *sample_shape]) or seeds")
    if noise is None:
        if sample_shape is None:
            raise ValueError("sample_shape is needed to draw step noise from seeds")
        if len(seeds) != sample_shape[0]:
            raise ValueError(f"{len(seeds)} seeds for a batch of {sample_shape[0]}")
        noise = step_noise(seeds, num_steps, tuple(sample_shape)[1:])
    noise = jnp.asarray(noise, jnp.float32)
    if noise.shape[0] != num_steps:
        raise ValueError(f"noise has {noise.shape[0]} steps; the schedule has {num_steps}")
    if sample_shape is not None and noise.shape[1:] != tuple(sample_shape):
        raise ValueError(f"noise shape {noise.shape[1:]} per step != sample_shape {sample_shape}")
    return noise


__all__ = [
    "BETA_SCHEDULES",
    "DIFFUSERS_SCHEDULER_KEYS",
    "PREDICTION_TYPES",
    "TIMESTEP_SPACINGS",
    "ClassicConfigError",
    "NoiseScheduleConfig",
    "add_noise",
    "alphas_cumprod",
    "check_choice",
    "as_config",
    "betas",
    "float32_step_inputs",
    "normalise_fields",
    "previous_alpha_bar",
    "read_config",
    "rescale_zero_terminal_snr",
    "sigma_to_timestep",
    "spaced_timesteps",
    "step_noise",
    "torch_linspace",
    "train_sigmas",
    "unit_noise_sigma",
    "unscaled_model_input",
    "velocity",
]
