"""The DDPM (epsilon / v-prediction) training math vs diffusers (PyTorch).

- SNR equals ``diffusers.training_utils.compute_snr`` at every timestep to an ulp or so
  (reached: 2.8e-7 relative for SD's scaled_linear, 2.3e-7 linear, 3.3e-7 cosine, 5.6e-7 with
  zero-terminal SNR; ~1% of values differ at all): PyTorch's float32 ``sqrt`` (MKL) is not
  correctly rounded for every input, and the zero-SNR rescaled ``alphas_cumprod`` inherit that.
- min-SNR-gamma weights equal ``train_text_to_image.py``'s formula on the same SNR exactly; at
  zero SNR (epsilon, zero-terminal SNR) diffusers gives NaN and we give the limit 1.
- One whole training loss (offset noise, input perturbation, epsilon / v target, min-SNR)
  equals the script's arithmetic in PyTorch given the same random draws and prediction (1e-6).
- Timesteps: integers over all of ``[0, T)``, uniform (chi-square); eval timesteps rounded and
  clamped; offset noise is one value per sample and channel with std ``noise_offset``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_snr

from jaxcore import ddpm_objective as ddpm
from jaxcore.schedulers import classic

SD = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
SCHEDULES = {
    "sd": SD,
    "sd-zero-snr-v": {**SD, "rescale_betas_zero_snr": True, "prediction_type": "v_prediction"},
    "linear": {},
    "cosine": {"beta_schedule": "squaredcos_cap_v2"},
}
ALL_STEPS = np.arange(1000)


def _pair(name: str):
    config = SCHEDULES[name]
    return classic.NoiseScheduleConfig(**config), DDPMScheduler(**config)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_snr_matches_compute_snr(name):
    ours_config, reference = _pair(name)
    expected = compute_snr(reference, torch.from_numpy(ALL_STEPS)).numpy()
    ours = np.asarray(ddpm.snr(ours_config, jnp.asarray(ALL_STEPS)))
    assert ours.dtype == np.float32
    if ours_config.rescale_betas_zero_snr:
        assert ours[-1] == expected[-1] == 0.0
    # compute_snr takes float32 square roots in PyTorch, whose CPU rounding depends on the
    # vector unit: mostly bit for bit on Intel, 1.4e-5 relative at worst on an AMD EPYC
    # (AVX-512); ours computes the same formula in float32 with IEEE square roots
    np.testing.assert_allclose(ours, expected, rtol=3e-5, atol=0)


@pytest.mark.parametrize("kind", ddpm.KINDS)
@pytest.mark.parametrize("gamma", [1.0, 5.0])
def test_min_snr_weights_match_the_training_script(kind, gamma):
    _, reference = _pair("sd-zero-snr-v")
    timesteps = torch.arange(1000)
    snr = compute_snr(reference, timesteps)
    # train_text_to_image.py, as written there
    weights = torch.stack([snr, gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    weights = weights / snr if kind == "epsilon" else weights / (snr + 1)
    ours = np.asarray(ddpm.min_snr_weights(jnp.asarray(snr.numpy()), gamma, kind))
    expected = weights.numpy()
    np.testing.assert_array_equal(ours[:-1], expected[:-1])
    if kind == "epsilon":  # 0 / 0 in diffusers; the limit of min(snr, gamma) / snr is 1
        assert np.isnan(expected[-1]) and ours[-1] == 1.0
    else:
        assert ours[-1] == expected[-1] == 0.0
    assert np.all((ours > 0) | (np.arange(1000) == 999)) and np.all(ours <= 1)


def _script_loss(reference, latents, noise, offset_draw, perturb_draw, timesteps, pred, cfg):
    """train_text_to_image.py's loss arithmetic in PyTorch, from given random draws."""
    latents, noise, pred = (torch.tensor(np.asarray(a)) for a in (latents, noise, pred))
    timesteps = torch.tensor(np.asarray(timesteps)).long()
    noise = noise + cfg["noise_offset"] * torch.tensor(np.asarray(offset_draw))
    new_noise = noise + cfg["input_perturbation"] * torch.tensor(np.asarray(perturb_draw))
    noisy = reference.add_noise(latents, new_noise, timesteps)
    if reference.config.prediction_type == "epsilon":
        target = noise
    else:
        target = reference.get_velocity(latents, noise, timesteps)
    model_pred = pred + 0.5 * noisy  # a fixed "model" of the noisy input
    loss = torch.nn.functional.mse_loss(model_pred, target, reduction="none")
    loss = loss.mean(dim=list(range(1, loss.ndim)))
    snr = compute_snr(reference, timesteps)
    weights = torch.stack([snr, cfg["snr_gamma"] * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    if reference.config.prediction_type == "epsilon":
        weights = weights / snr
    else:
        weights = weights / (snr + 1)
    return (loss * weights).mean().item()


@pytest.mark.parametrize("name", ["sd", "sd-zero-snr-v"])
def test_a_training_loss_matches_the_script(name):
    config, reference = _pair(name)
    cfg = {"noise_offset": 0.1, "input_perturbation": 0.1, "snr_gamma": 5.0}
    key_t, key_n, key_o, key_p, key_x = jax.random.split(jax.random.key(3), 5)
    shape = (4, 4, 8, 8)
    latents = jax.random.normal(key_x, shape)
    pred = 0.3 * latents
    timesteps = jnp.array([0, 1, 500, 998])
    noise = jax.random.normal(key_n, shape)

    offset = ddpm.offset_noise(key_o, noise, cfg["noise_offset"])
    perturbed = ddpm.perturb_noise(key_p, offset, cfg["input_perturbation"])
    noisy = ddpm.add_noise(config, latents, perturbed, timesteps)
    target = ddpm.target(config.prediction_type, config, latents, offset, timesteps)
    per_sample = jnp.mean((pred + 0.5 * noisy - target) ** 2, axis=(1, 2, 3))
    weights = ddpm.min_snr_weights(
        ddpm.snr(config, timesteps), cfg["snr_gamma"], config.prediction_type
    )
    ours = float(jnp.mean(per_sample * weights))

    offset_draw = jax.random.normal(key_o, (4, 4, 1, 1))  # the draws the functions made
    perturb_draw = jax.random.normal(key_p, shape)
    expected = _script_loss(
        reference, latents, noise, offset_draw, perturb_draw, timesteps, pred, cfg
    )
    assert ours == pytest.approx(expected, rel=1e-6)


def test_velocity_target_matches_get_velocity():
    config, reference = _pair("sd-zero-snr-v")
    rng = np.random.default_rng(0)
    clean, noise = (rng.standard_normal((3, 4, 4, 4), np.float32) for _ in range(2))
    timesteps = np.array([0, 700, 999])
    ours = ddpm.target("v_prediction", config, jnp.asarray(clean), jnp.asarray(noise), timesteps)
    expected = reference.get_velocity(
        torch.from_numpy(clean), torch.from_numpy(noise), torch.from_numpy(timesteps)
    )
    np.testing.assert_allclose(np.asarray(ours), expected.numpy(), rtol=0, atol=1e-6)
    assert ddpm.target("epsilon", config, clean, noise, timesteps) is noise
    with pytest.raises(ValueError, match="'sample'"):
        ddpm.target("sample", config, clean, noise, timesteps)


def test_timesteps_are_uniform_integers_over_the_schedule():
    t = np.asarray(ddpm.sample_timesteps(jax.random.key(0), 200_000, 10))
    assert t.dtype == np.int32 and t.min() == 0 and t.max() == 9
    counts = np.bincount(t, minlength=10)
    chi2 = float(np.sum((counts - 20_000) ** 2 / 20_000))
    assert chi2 < 27.9  # chi-square, 9 degrees of freedom, p = 0.001
    wide = np.asarray(ddpm.sample_timesteps(jax.random.key(1), 100_000, 1000))
    assert wide.min() == 0 and wide.max() == 999


def test_eval_timesteps_round_and_clamp():
    got = ddpm.eval_timesteps(jnp.array([0, 1, 499.4, 499.6, 999, 1000, 1200, -3]), 1000)
    np.testing.assert_array_equal(np.asarray(got), [0, 1, 499, 500, 999, 999, 999, 0])
    np.testing.assert_array_equal(np.asarray(ddpm.eval_timesteps(jnp.array([1000]), 50)), [49])


def test_offset_noise_is_per_sample_and_channel():
    noise = jnp.zeros((512, 4, 8, 8))
    out = np.asarray(ddpm.offset_noise(jax.random.key(2), noise, 0.1))
    offsets = out[:, :, :1, :1]
    np.testing.assert_array_equal(out, np.broadcast_to(offsets, out.shape))  # constant in space
    assert np.std(offsets) == pytest.approx(0.1, rel=0.05)
    assert abs(np.mean(offsets)) < 0.01
    video = ddpm.offset_noise(jax.random.key(2), jnp.zeros((2, 4, 3, 8, 8)), 0.1)
    assert np.ptp(np.asarray(video)[0, 0]) == 0.0  # constant over frames too


def test_input_perturbation_adds_noise_of_that_scale():
    noise = jnp.zeros((64, 4, 16, 16))
    out = np.asarray(ddpm.perturb_noise(jax.random.key(4), noise, 0.1))
    assert np.std(out) == pytest.approx(0.1, rel=0.02)


def test_gamma_and_kind_are_checked():
    with pytest.raises(ValueError, match="snr_gamma"):
        ddpm.min_snr_weights(jnp.ones(2), 0.0, "epsilon")
    with pytest.raises(ValueError, match="'sample'"):
        ddpm.min_snr_weights(jnp.ones(2), 5.0, "sample")
