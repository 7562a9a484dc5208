"""Flow-matching (rectified-flow) training math: pure, jittable functions.

The forward process interpolates data and noise linearly, ``x_t = (1 - t) x0 + t noise``, and
the model regresses the constant velocity ``v = noise - x0`` (Liu et al., arXiv 2209.03003;
Lipman et al., arXiv 2210.02747; Esser et al. "SD3", arXiv 2403.03206). Wan 2.1 and
MaxDiffusion's Wan trainer use this with shifted uniform timesteps; the model is fed
``1000 * t``.

Loss weights, when used, are normalised over a fixed grid of timesteps (the *schedule*), never
over the batch: MaxDiffusion normalises its Gaussian weight over the batch's own timesteps, so
a batch of one is NaN and each batch's lowest-weight sample gets weight 0. Here a weight is a
fixed function of ``t`` alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

TIMESTEP_METHODS = (
    "uniform",
    "logit_normal",
    "shifted",
    "shifted_logit_normal",
    "stretched_logit_normal",
)
# ltx-trainer's LTX-2 sampler (ShiftedLogitNormalTimestepSampler): the shifted logit-normal
# stretched to [0, 1] between its 0.5th and 99.9th percentiles (the standard normal's, x std),
# values below STRETCH_EPS reflected about it, and a share of draws uniform on [eps, 1)
STRETCH_PERCENTILES = (-2.5758, 3.0902)
STRETCH_EPS = 1e-3
STRETCH_UNIFORM_SHARE = 0.1
# LTX-Video-Trainer's shifted_logit_normal: the logit mean linear in the latent token count,
# through these (tokens, mean) points (its _get_shift_for_sequence_length), not clipped
SHIFT_TOKENS, SHIFT_MEANS = (1024, 4096), (0.95, 2.05)


def shifted_logit_mean(tokens: int) -> float:
    """The logit mean of ``shifted_logit_normal`` for ``tokens`` latent tokens per sample: linear
    through (1024, 0.95) and (4096, 2.05) (LTX-Video-Trainer)."""
    (lo, hi), (low, high) = SHIFT_TOKENS, SHIFT_MEANS
    slope = (high - low) / (hi - lo)
    return float(slope * tokens + low - slope * lo)


WEIGHT_SCHEMES = ("none", "gaussian")

# MaxDiffusion's Wan trainer keeps a little noise at t = 0: sigma = (1 - t) * SIGMA_MIN + t.
MAXDIFFUSION_SIGMA_MIN = 0.003 / 1.002

# Largest float32 below 1: keeps sampled t in [0, 1) where rounding would give exactly 1.
_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


def shift_timesteps(t: jax.Array, shift: float) -> jax.Array:
    """Static shift ``t' = s t / (1 + (s - 1) t)`` (SD3 eq. 23; Wan, MaxDiffusion training).

    ``s > 1`` moves mass towards high noise; ``s = 1`` is the identity; 0 and 1 are fixed.
    """
    return shift * t / (1 + (shift - 1) * t)


def sample_timesteps(
    rng: jax.Array,
    batch: int,
    method: str = "shifted",
    *,
    shift: float = 3.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    t_range: tuple[float, float] = (0.0, 1.0),
) -> jax.Array:
    """Samples ``[batch]`` float32 training times ``t`` in [0, 1) (1 is pure noise).

    ``t_range = (lo, hi)``: the method's distribution truncated to ``lo <= t < hi`` (exactly:
    each method draws its underlying variable from the matching interval), e.g. the timesteps
    one expert of a two-expert model (Wan 2.2) handles.

    Methods:
      ``"uniform"``: ``t ~ U[0, 1)``.
      ``"logit_normal"``: ``t = sigmoid(n)``, ``n ~ N(logit_mean, logit_std^2)`` (SD3 sec. 3.1).
      ``"shifted"``: ``t ~ U[0, 1)`` then :func:`shift_timesteps` with ``shift`` (Wan /
        MaxDiffusion default, ``shift = 3``).
      ``"shifted_logit_normal"``: ``"logit_normal"`` with the mean given by the caller from
        the token count (:func:`shifted_logit_mean`; LTX-Video-Trainer's default).
      ``"stretched_logit_normal"``: ltx-trainer's LTX-2 default, :func:`stretched_logit_normal`
        of ``"shifted_logit_normal"``'s draw (no ``t_range``).
    """
    if method not in TIMESTEP_METHODS:
        raise ValueError(f"unknown timestep method {method!r}; expected one of {TIMESTEP_METHODS}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if logit_std <= 0:
        raise ValueError(f"logit_std must be > 0, got {logit_std}")
    lo, hi = (float(v) for v in t_range)
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"t_range must satisfy 0 <= lo < hi <= 1, got {t_range}")
    if method == "stretched_logit_normal":
        if (lo, hi) != (0.0, 1.0):
            raise ValueError(f"{method} takes no t_range (got {t_range})")
        keys = jax.random.split(rng, 3)
        normal = jax.random.normal(keys[0], (batch,), jnp.float32)
        uniform = jax.random.uniform(keys[1], (batch,), jnp.float32)
        choice = jax.random.uniform(keys[2], (batch,), jnp.float32)
        t = stretched_logit_normal(normal, uniform, choice, logit_mean, logit_std)
        return jnp.clip(t, 0.0, _BELOW_ONE)
    if method in ("logit_normal", "shifted_logit_normal"):
        # t = sigmoid(mean + std n) is monotone in n: truncate n to the matching interval
        if (lo, hi) == (0.0, 1.0):
            normal = jax.random.normal(rng, (batch,), jnp.float32)
        else:
            bound = [(_logit(v) - logit_mean) / logit_std for v in (lo, hi)]
            normal = jax.random.truncated_normal(rng, bound[0], bound[1], (batch,), jnp.float32)
        t = jax.nn.sigmoid(logit_mean + logit_std * normal)
    else:
        if method == "shifted":  # the shift is monotone: draw u where shift(u) lands in range
            lo, hi = unshift_timesteps(lo, shift), unshift_timesteps(hi, shift)
        t = jax.random.uniform(rng, (batch,), jnp.float32, minval=lo, maxval=hi)
        if method == "shifted":
            t = shift_timesteps(t, shift)
    low, high = (float(v) for v in t_range)
    # rounding (sigmoid of a large value, the shift of a t near 1) must not leave the range
    return jnp.clip(t, low, min(_below(high), _BELOW_ONE))


def stretched_logit_normal(normal, uniform, choice, mean: float, std: float = 1.0) -> jax.Array:
    """ltx-trainer's LTX-2 timesteps from standard draws (``normal`` ~ N(0, 1), ``uniform`` and
    ``choice`` ~ U[0, 1), one each per sample): ``s = sigmoid(mean + std normal)`` stretched to
    ``(s - p_lo) / (p_hi - p_lo)`` with ``p = sigmoid(mean + std z)`` at the
    :data:`STRETCH_PERCENTILES` ``z``, reflected to ``2 eps - s`` below ``eps``
    (:data:`STRETCH_EPS`), clipped to [0, 1]; where ``choice`` < :data:`STRETCH_UNIFORM_SHARE`
    the draw is ``(1 - eps) uniform + eps`` instead. Jittable."""
    eps = jnp.float32(STRETCH_EPS)
    low, high = (jax.nn.sigmoid(jnp.float32(mean + std * z)) for z in STRETCH_PERCENTILES)
    raw = (jax.nn.sigmoid(mean + std * normal) - low) / (high - low)
    stretched = jnp.clip(jnp.where(raw >= eps, raw, 2 * eps - raw), 0.0, 1.0)
    flat = (1 - eps) * uniform + eps
    return jnp.where(choice > STRETCH_UNIFORM_SHARE, stretched, flat)


def _logit(p: float) -> float:
    if p <= 0.0:
        return -np.inf
    if p >= 1.0:
        return np.inf
    return float(np.log(p) - np.log1p(-p))


def _below(value: float) -> float:
    """The largest float32 below ``value``."""
    return float(np.nextafter(np.float32(value), np.float32(0)))


def unshift_timesteps(t: float, shift: float) -> float:
    """The inverse of :func:`shift_timesteps`: ``u = t / (s - (s - 1) t)``."""
    return t / (shift - (shift - 1) * t)


def model_timesteps(t: jax.Array, num_train_timesteps: int = 1000) -> jax.Array:
    """The timestep the model is conditioned on: ``num_train_timesteps * t`` (float)."""
    return num_train_timesteps * t


def _per_sample(values: jax.Array, ndim: int) -> jax.Array:
    """Reshapes ``[B]`` per-sample values to broadcast against a rank-``ndim`` batch."""
    return values.reshape(values.shape + (1,) * (ndim - values.ndim))


def add_noise(
    x0: jax.Array, noise: jax.Array, t: jax.Array, *, sigma_min: float = 0.0
) -> jax.Array:
    """Noisy sample ``x_t = (1 - sigma) x0 + sigma noise`` with ``sigma = (1 - t) sigma_min + t``.

    Args:
      x0: clean latents ``[B, ...]``.
      noise: standard normal noise, same shape.
      t: ``[B]`` times in [0, 1].
      sigma_min: 0 (default) gives plain ``sigma = t`` (diffusers ``scale_noise``, Wan). Use
        :data:`MAXDIFFUSION_SIGMA_MIN` to reproduce MaxDiffusion's Wan trainer, which keeps a
        residual noise level at ``t = 0``. The velocity target stays ``noise - x0`` either way.
    """
    if x0.shape != noise.shape:
        raise ValueError(f"x0 shape {x0.shape} != noise shape {noise.shape}")
    if t.shape != x0.shape[:1]:
        raise ValueError(f"t must have shape [batch] = {x0.shape[:1]}, got {t.shape}")
    sigma = _per_sample((1 - t) * sigma_min + t, x0.ndim)
    return (1 - sigma) * x0 + sigma * noise


def velocity_target(x0: jax.Array, noise: jax.Array) -> jax.Array:
    """Regression target of rectified flow: ``d x_t / d t = noise - x0``."""
    return noise - x0


def _gaussian(t: jax.Array, center: float, sharpness: float) -> jax.Array:
    """``exp(-sharpness (t - center)^2)``; with the defaults, DiffSynth/MaxDiffusion's bell
    ``exp(-2 ((T - 500) / 1000)^2)`` written in ``t = T / 1000``."""
    return jnp.exp(-sharpness * (t - center) ** 2)


def weight_grid(grid_size: int = 1000, grid_shift: float = 1.0) -> jax.Array:
    """The fixed schedule weights are normalised over: ``shift(i / grid_size)``, i < grid_size.

    ``grid_shift`` equal to the training shift makes the mean weight 1 under the shifted
    timestep distribution rather than under the uniform one.
    """
    grid = jnp.arange(grid_size, dtype=jnp.float32) / grid_size
    return shift_timesteps(grid, grid_shift)


def loss_weights(
    t: jax.Array,
    scheme: str = "none",
    *,
    center: float = 0.5,
    sharpness: float = 2.0,
    grid_size: int = 1000,
    grid_shift: float = 1.0,
) -> jax.Array:
    """Per-sample loss weights ``[B]`` for times ``t`` (a fixed function of ``t`` alone).

    ``"none"``: all ones. ``"gaussian"``: a bell around ``center``, shifted so its minimum over
    the schedule is 0 and scaled so its mean over the schedule is 1 (the DiffSynth/MaxDiffusion
    weighting, but normalised over :func:`weight_grid` rather than over the batch, so a batch of
    one, or a batch sharing one timestep, gets the same finite weights as any other).
    """
    if scheme not in WEIGHT_SCHEMES:
        raise ValueError(f"unknown loss weight scheme {scheme!r}; expected one of {WEIGHT_SCHEMES}")
    if scheme == "none":
        return jnp.ones(t.shape, jnp.float32)
    grid_values = _gaussian(weight_grid(grid_size, grid_shift), center, sharpness)
    floor = jnp.min(grid_values)
    scale = jnp.mean(grid_values - floor)
    # The grid spans [0, 1), so for t in [0, 1) the floor is the global minimum and weights >= 0;
    # clamp anyway so a t outside the grid's span can never produce a negative weight.
    return jnp.maximum(_gaussian(t, center, sharpness) - floor, 0.0) / scale


def flow_matching_loss(
    pred: jax.Array, target: jax.Array, weights: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Weighted MSE: returns ``(loss, per_sample)``.

    ``per_sample[b] = weights[b] * mean((pred[b] - target[b])^2)`` over all non-batch dims, so
    each sample's loss depends on that sample alone; ``loss = mean(per_sample)``. Computed in
    float32 whatever the input dtype.
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred shape {pred.shape} != target shape {target.shape}")
    error = (pred.astype(jnp.float32) - target.astype(jnp.float32)) ** 2
    per_sample = jnp.mean(error, axis=tuple(range(1, error.ndim)))
    if weights is not None:
        if weights.shape != per_sample.shape:
            raise ValueError(
                f"weights must have shape [batch] = {per_sample.shape}, got {weights.shape}"
            )
        per_sample = per_sample * weights.astype(jnp.float32)
    return jnp.mean(per_sample), per_sample
