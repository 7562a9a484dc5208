"""Flow-matching training math: timestep sampling, noising, target, weights, loss.

References: diffusers ``FlowMatchEulerDiscreteScheduler`` (training sigma grid, ``scale_noise``)
and ``training_utils.compute_density_for_timestep_sampling`` (logit-normal), MaxDiffusion's Wan
trainer formulas (sigma_min variant), DiffSynth's Gaussian weight (re-derived in numpy here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.training_utils import compute_density_for_timestep_sampling

from jaxcore import flow_matching as fm

SHAPE = (4, 3, 2, 5, 6)  # [B, C, F, H, W]


def _data(seed: int = 0, shape=SHAPE):
    rng = np.random.default_rng(seed)
    x0 = rng.standard_normal(shape).astype(np.float32)
    noise = rng.standard_normal(shape).astype(np.float32)
    return jnp.asarray(x0), jnp.asarray(noise)


# ---------------------------------------------------------------- timestep sampling


@pytest.mark.parametrize("method", fm.TIMESTEP_METHODS)
@pytest.mark.parametrize("batch", [1, 257])
def test_sample_timesteps_shape_dtype_range(method, batch):
    sample = jax.jit(fm.sample_timesteps, static_argnums=(1, 2))
    t = sample(jax.random.key(0), batch, method)
    assert t.shape == (batch,) and t.dtype == jnp.float32
    assert bool(jnp.all((t >= 0) & (t < 1)))


def test_sample_timesteps_never_reaches_one():
    """sigmoid(30) is exactly 1.0 in float32; the sampler must still return t < 1."""
    t = fm.sample_timesteps(jax.random.key(1), 64, "logit_normal", logit_mean=30.0)
    assert float(jnp.max(t)) < 1.0
    assert float(jnp.min(t)) > 0.999


def test_shifted_is_shift_of_uniform_with_same_key():
    key = jax.random.key(2)
    uniform = fm.sample_timesteps(key, 1000, "uniform")
    shifted = fm.sample_timesteps(key, 1000, "shifted", shift=3.0)
    np.testing.assert_allclose(shifted, 3 * uniform / (1 + 2 * uniform), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_shift_formula_matches_diffusers_training_grid(shift):
    """diffusers' scheduler builds its training sigmas as shift(T/1000) in float32."""
    reference = FlowMatchEulerDiscreteScheduler(shift=shift)
    grid = np.linspace(1, 1000, 1000, dtype=np.float32)[::-1] / np.float32(1000)
    ours = fm.shift_timesteps(jnp.asarray(grid.copy()), shift)
    np.testing.assert_allclose(ours, reference.sigmas.numpy(), rtol=1e-6, atol=1e-7)


def test_uniform_and_shifted_moments():
    """Sample means match the analytic means within 5 standard errors (n = 40,000)."""
    n = 40_000
    uniform = np.asarray(fm.sample_timesteps(jax.random.key(3), n, "uniform"))
    assert abs(uniform.mean() - 0.5) < 5 * np.sqrt(1 / 12 / n)
    shifted = np.asarray(fm.sample_timesteps(jax.random.key(3), n, "shifted", shift=3.0))
    u = (np.arange(1_000_000) + 0.5) / 1_000_000  # midpoint rule for E[3u / (1 + 2u)]
    expected = (3 * u / (1 + 2 * u)).mean()
    assert abs(shifted.mean() - expected) < 5 * shifted.std() / np.sqrt(n)
    assert shifted.mean() > uniform.mean() + 0.1  # shift > 1 moves mass to high noise


def test_logit_normal_matches_diffusers_distribution():
    """Quantiles of ours vs diffusers' SD3 sampler (different RNGs; n = 40,000 each)."""
    n, mean, std = 40_000, 0.3, 1.2
    ours = np.asarray(
        fm.sample_timesteps(jax.random.key(4), n, "logit_normal", logit_mean=mean, logit_std=std)
    )
    generator = torch.Generator().manual_seed(0)
    reference = compute_density_for_timestep_sampling(
        "logit_normal", n, logit_mean=mean, logit_std=std, generator=generator
    ).numpy()
    quantiles = np.linspace(0.05, 0.95, 19)
    np.testing.assert_allclose(
        np.quantile(ours, quantiles), np.quantile(reference, quantiles), atol=0.01
    )
    logits = np.log(ours / (1 - ours))
    assert abs(logits.mean() - mean) < 5 * std / np.sqrt(n)
    assert abs(logits.std() - std) < 0.02


def _ltx_trainer_sample(normal, uniform, choice, mu: float, std: float = 1.0):
    """ltx-trainer's LTX-2 sampler (``ShiftedLogitNormalTimestepSampler.sample``, written out in
    torch from its source: packages/ltx-trainer/src/ltx_trainer/timestep_samplers.py) on
    given draws instead of its own ``torch.randn`` / ``torch.rand`` calls."""
    eps, share = 1e-3, 0.1
    samples = torch.sigmoid(normal * std + mu)
    high = torch.sigmoid(torch.tensor(mu + 3.0902 * std))
    low = torch.sigmoid(torch.tensor(mu - 2.5758 * std))
    raw = (samples - low) / (high - low)
    stretched = torch.clamp(torch.where(raw >= eps, raw, 2 * eps - raw), 0, 1)
    flat = (1 - eps) * uniform + eps
    return torch.where(choice > share, stretched, flat)


@pytest.mark.parametrize("tokens", [96, 1024, 6144])
def test_stretched_logit_normal_is_ltx_trainers_on_the_same_draws(tokens):
    """The same normal / uniform / choice draws give ltx-trainer's timesteps (float32), its
    shift linear in the token count; each branch (reflected, clipped, uniform) is hit."""
    rng = np.random.default_rng(tokens)
    n = 20_000
    normal = rng.standard_normal(n).astype(np.float32)
    normal[:4] = (-6.0, -2.6, 3.2, 8.0)  # below eps (reflected), near the bounds, past 1
    uniform, choice = rng.random(n, np.float32), rng.random(n, np.float32)
    choice[:4] = 0.5  # the stretched branch for the four above
    mu = fm.shifted_logit_mean(tokens)
    ours = np.asarray(fm.stretched_logit_normal(normal, uniform, choice, mu))
    want = _ltx_trainer_sample(*(torch.from_numpy(a) for a in (normal, uniform, choice)), mu)
    np.testing.assert_allclose(ours, want.numpy(), rtol=0, atol=2e-6)
    assert ours[3] == 1.0  # clipped
    low = 1 / (1 + np.exp(-(mu - 2.5758)))
    assert 1 / (1 + np.exp(-(mu - 6.0))) < low and ours[0] > 1e-3  # reflected about eps
    assert np.array_equal(ours[choice <= 0.1], ((1 - 1e-3) * uniform + 1e-3)[choice <= 0.1])


def test_stretched_logit_normal_sampler_matches_ltx_trainers_distribution():
    """sample_timesteps' draws vs ltx-trainer's with torch's own RNG: two-sample
    Kolmogorov-Smirnov distance under 0.01 (n = 100,000 each; the 0.1% critical value is
    0.0087), and a tenth of the mass spread uniformly."""
    n, tokens = 100_000, 6144
    mu = fm.shifted_logit_mean(tokens)
    ours = np.sort(
        np.asarray(
            fm.sample_timesteps(jax.random.key(7), n, "stretched_logit_normal", logit_mean=mu)
        )
    )
    generator = torch.Generator().manual_seed(0)
    draws = (torch.randn(n, generator=generator), torch.rand(n, generator=generator))
    want = _ltx_trainer_sample(*draws, torch.rand(n, generator=generator), mu).numpy()
    want = np.sort(want)
    grid = np.union1d(ours, want)
    distance = np.abs(
        np.searchsorted(ours, grid, "right") / n - np.searchsorted(want, grid, "right") / n
    ).max()
    print(f"KS distance {distance:.4f}")
    assert distance < 0.01
    assert ours.min() >= 0 and ours.max() < 1
    with pytest.raises(ValueError, match="t_range"):
        fm.sample_timesteps(jax.random.key(0), 4, "stretched_logit_normal", t_range=(0.0, 0.5))


def test_model_timesteps_are_1000_t():
    t = jnp.asarray([0.0, 0.25, 0.999])
    np.testing.assert_allclose(fm.model_timesteps(t), [0.0, 250.0, 999.0], rtol=1e-6)


# ---------------------------------------------------------------- noising and target


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_add_noise_matches_diffusers_scale_noise(shift):
    reference = FlowMatchEulerDiscreteScheduler(shift=shift)
    indices = [0, 137, 500, 998]
    x0, noise = _data(5)
    t = reference.sigmas[indices]
    expected = reference.scale_noise(
        torch.from_numpy(np.array(x0)),
        reference.timesteps[indices],
        torch.from_numpy(np.array(noise)),
    ).numpy()
    ours = fm.add_noise(x0, noise, jnp.asarray(t.numpy()))
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6)


def test_add_noise_endpoints_and_maxdiffusion_sigma_min():
    x0, noise = _data(6)
    t = jnp.asarray([0.0, 1.0, 0.3, 0.7])
    plain = fm.add_noise(x0, noise, t)
    np.testing.assert_array_equal(plain[0], x0[0])
    np.testing.assert_array_equal(plain[1], noise[1])

    s_min = fm.MAXDIFFUSION_SIGMA_MIN
    shifted = fm.add_noise(x0, noise, t, sigma_min=s_min)
    sigma = (1 - np.asarray(t)) * s_min + np.asarray(t)  # MaxDiffusion wan_trainer formula
    sigma = sigma.reshape(-1, 1, 1, 1, 1)
    expected = (1 - sigma) * np.asarray(x0) + sigma * np.asarray(noise)
    np.testing.assert_allclose(shifted, expected, rtol=1e-6, atol=1e-6)
    assert not np.allclose(shifted[0], x0[0])  # residual noise at t = 0
    np.testing.assert_allclose(shifted[1], noise[1], rtol=1e-6, atol=1e-6)


def test_velocity_target_is_time_derivative_of_add_noise():
    x0, noise = _data(7)
    t = jnp.asarray([0.1, 0.4, 0.6, 0.9])
    _, dxdt = jax.jvp(lambda t: fm.add_noise(x0, noise, t), (t,), (jnp.ones_like(t),))
    np.testing.assert_allclose(dxdt, fm.velocity_target(x0, noise), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- weights


def test_no_weights_are_ones():
    np.testing.assert_array_equal(fm.loss_weights(jnp.asarray([0.1, 0.9]), "none"), [1.0, 1.0])


def test_gaussian_weights_match_schedule_normalised_reference():
    """DiffSynth/MaxDiffusion's bell over T = 1000 t, min-shifted and mean-normalised over the
    schedule grid (not over the batch), recomputed in float64 numpy."""
    grid = np.arange(1000) / 1000
    bell = np.exp(-2 * ((grid * 1000 - 500) / 1000) ** 2)
    shifted_bell = bell - bell.min()
    expected_on_grid = shifted_bell / shifted_bell.mean()
    ours_on_grid = fm.loss_weights(jnp.asarray(grid, jnp.float32), "gaussian")
    np.testing.assert_allclose(ours_on_grid, expected_on_grid, rtol=1e-5, atol=1e-6)
    assert abs(float(jnp.mean(ours_on_grid)) - 1.0) < 1e-5
    assert float(jnp.min(ours_on_grid)) == 0.0


def test_gaussian_weights_are_per_timestep_not_per_batch():
    """A batch of one, or a batch sharing one timestep, is finite and gets the same weight the
    timestep gets anywhere else (MaxDiffusion's batch normalisation gives NaN here)."""
    batch = jnp.asarray([0.2, 0.5, 0.8])
    weights = fm.loss_weights(batch, "gaussian")
    single = fm.loss_weights(jnp.asarray([0.5]), "gaussian")
    shared = fm.loss_weights(jnp.full((4,), 0.5), "gaussian")
    assert bool(jnp.all(jnp.isfinite(weights))) and bool(jnp.all(jnp.isfinite(shared)))
    np.testing.assert_allclose(single, weights[1:2], rtol=1e-7)
    np.testing.assert_allclose(shared, jnp.full((4,), weights[1]), rtol=1e-7)
    assert float(weights[1]) > float(weights[0]) > 0  # peaks at the centre


def test_gaussian_weights_grid_shift_normalises_under_shifted_sampling():
    grid = fm.weight_grid(1000, grid_shift=3.0)
    weights = fm.loss_weights(grid, "gaussian", grid_shift=3.0)
    assert abs(float(jnp.mean(weights)) - 1.0) < 1e-5


# ---------------------------------------------------------------- loss


def test_loss_is_zero_for_perfect_prediction():
    x0, noise = _data(8)
    target = fm.velocity_target(x0, noise)
    t = jnp.asarray([0.1, 0.3, 0.5, 0.7])
    loss, per_sample = fm.flow_matching_loss(target, target, fm.loss_weights(t, "gaussian"))
    assert float(loss) == 0.0
    np.testing.assert_array_equal(per_sample, np.zeros(4))


def test_loss_matches_numpy_weighted_mse():
    pred, target = _data(9)
    weights = jnp.asarray([0.5, 1.0, 2.0, 0.0])
    loss, per_sample = fm.flow_matching_loss(pred, target, weights)
    error = (np.asarray(pred, np.float64) - np.asarray(target, np.float64)) ** 2
    expected = error.reshape(4, -1).mean(axis=1) * np.asarray(weights)
    np.testing.assert_allclose(per_sample, expected, rtol=1e-5)
    np.testing.assert_allclose(loss, expected.mean(), rtol=1e-5)
    unweighted, _ = fm.flow_matching_loss(pred, target)
    np.testing.assert_allclose(unweighted, error.mean(), rtol=1e-5)


def test_batch_of_one_gives_finite_loss_and_gradient():
    x0, noise = _data(10, shape=(1, 3, 2, 5, 6))

    def loss_fn(scale, t):
        x_t = fm.add_noise(x0, noise, t)
        pred = scale * x_t
        weights = fm.loss_weights(t, "gaussian")
        return fm.flow_matching_loss(pred, fm.velocity_target(x0, noise), weights)[0]

    t = fm.sample_timesteps(jax.random.key(11), 1, "shifted")
    loss, grad = jax.jit(jax.value_and_grad(loss_fn))(jnp.float32(0.5), t)
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert np.isfinite(float(grad))


def test_per_sample_losses_do_not_depend_on_batch_composition():
    pred, target = _data(12)
    t = jnp.asarray([0.05, 0.5, 0.5, 0.95])
    weights = fm.loss_weights(t, "gaussian")
    _, full = fm.flow_matching_loss(pred, target, weights)
    order = jnp.asarray([3, 1, 0, 2])
    _, permuted = fm.flow_matching_loss(pred[order], target[order], weights[order])
    np.testing.assert_allclose(permuted, full[order], rtol=1e-6)
    for i in range(4):
        _, alone = fm.flow_matching_loss(
            pred[i : i + 1], target[i : i + 1], fm.loss_weights(t[i : i + 1], "gaussian")
        )
        np.testing.assert_allclose(alone, full[i : i + 1], rtol=1e-6)


def test_loss_accepts_bfloat16_and_computes_in_float32():
    pred, target = _data(13)
    loss16, _ = fm.flow_matching_loss(pred.astype(jnp.bfloat16), target.astype(jnp.bfloat16))
    assert loss16.dtype == jnp.float32


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: fm.sample_timesteps(jax.random.key(0), 2, "cosine"), "timestep method 'cosine'"),
        (lambda: fm.sample_timesteps(jax.random.key(0), 2, "shifted", shift=0.0), "shift"),
        (lambda: fm.loss_weights(jnp.zeros(2), "snr"), "loss weight scheme 'snr'"),
        (lambda: fm.add_noise(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros(2)), "noise shape"),
        (lambda: fm.add_noise(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(3)), "t must"),
        (lambda: fm.flow_matching_loss(jnp.zeros((2, 3)), jnp.zeros((2, 4))), "target shape"),
        (
            lambda: fm.flow_matching_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones(3)),
            "weights must",
        ),
    ],
)
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("method", ["uniform", "shifted", "logit_normal"])
@pytest.mark.parametrize("t_range", [(0.875, 1.0), (0.0, 0.875), (0.3, 0.4)])
def test_sample_timesteps_truncated_to_a_range(method, t_range):
    """An expert's range: every sample inside it, and the truncated distribution equals the
    full one conditioned on the range (compared by quantiles of a large sample)."""
    key = jax.random.key(3)
    t = np.asarray(fm.sample_timesteps(key, 20000, method, shift=5.0, t_range=t_range))
    lo, hi = t_range
    assert t.min() >= lo and t.max() < hi
    full = np.asarray(fm.sample_timesteps(jax.random.key(4), 400000, method, shift=5.0))
    inside = np.sort(full[(full >= lo) & (full < hi)])
    # two-sample Kolmogorov-Smirnov distance; 0.02 is far above the noise of these sample
    # sizes (~0.012 at p = 0.001) and far below what a wrong truncation gives (> 0.1)
    grid = np.linspace(lo, hi, 201)
    cdf_t = np.searchsorted(np.sort(t), grid) / len(t)
    cdf_inside = np.searchsorted(inside, grid) / len(inside)
    assert np.abs(cdf_t - cdf_inside).max() < 0.02


def test_sample_timesteps_full_range_is_unchanged():
    """The default range draws exactly what it drew before ranges existed."""
    key = jax.random.key(9)
    normal = jax.random.normal(key, (16,), jnp.float32)
    expected = np.minimum(np.asarray(jax.nn.sigmoid(normal)), np.nextafter(np.float32(1), 0))
    got = fm.sample_timesteps(key, 16, "logit_normal")
    np.testing.assert_array_equal(np.asarray(got), expected)
    with pytest.raises(ValueError, match="t_range"):
        fm.sample_timesteps(key, 4, "uniform", t_range=(0.5, 0.5))
