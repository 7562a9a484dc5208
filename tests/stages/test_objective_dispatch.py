"""The training objective's dispatch by family (train's loss and evaluate's scoring).

A fake family whose denoiser is ``w * x + b * t / 1000`` (one scalar each) trains with
epsilon / v-prediction: its loss equals the MSE computed by hand in float64 numpy (rtol 1e-5)
from the same random draws, with and without noise offset, input perturbation and min-SNR
weights, eagerly and under ``jax.jit``; evaluate's per-record score at fixed timesteps is the
same formula at ``clip(round(t), 0, 999)``. A flow-matching family's loss and score are bit for
bit the code before the DDPM objectives. Refused, each naming what: an unknown objective, a
DDPM family without a noise schedule or whose schedule predicts ``sample``, DDPM-only keys
with flow matching, flow-only keys with DDPM.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcore import flow_matching as fm
from jaxcore.schedulers import classic
from stages.common import objective, scoring
from stages.common.errors import StageInputError
from stages.common.objective import ObjectiveSection, TrainingTarget

SD_SCHEDULE = {
    "_class_name": "PNDMScheduler",  # SD 2's; other schedulers' keys are ignored
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "skip_prk_steps": True,
    "prediction_type": "epsilon",
}
SHAPE = (4, 4, 6, 6)
PARAMS = {"w": jnp.float32(0.7), "b": jnp.float32(-0.4)}


class FakeFamily:
    """Just what the objective calls: ``name``, ``objective``, ``noise_schedule``, ``apply``."""

    name = "fake"

    def __init__(self, objective_name="epsilon", schedule=None, hook=True):
        self.objective = objective_name
        self.schedule = schedule
        if not hook:
            self.noise_schedule = None

    def noise_schedule(self, pipeline_dir):
        del pipeline_dir
        return self.schedule

    def apply(self, module, params, latents, timestep, conditioning):
        del module, conditioning
        t = timestep.reshape(-1, 1, 1, 1) / 1000.0
        return params["w"] * latents + params["b"] * t


def _family(prediction_type="epsilon", **extra):
    return FakeFamily("epsilon", {**SD_SCHEDULE, "prediction_type": prediction_type, **extra})


def _batch():
    x0 = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
    return {"latents": jnp.asarray(x0)}


def _by_hand(kind, schedule, x0, noise, timesteps, cfg, offset=None, perturb=None):
    """The loss in float64 numpy: diffusers' train_text_to_image.py written out."""
    abar = classic.alphas_cumprod(schedule).astype(np.float64)[timesteps].reshape(-1, 1, 1, 1)
    x0, noise = np.float64(x0), np.float64(noise)
    if offset is not None:
        noise = noise + cfg.noise_offset * np.float64(offset)
    model_noise = noise if perturb is None else noise + cfg.input_perturbation * np.float64(perturb)
    x_t = np.sqrt(abar) * x0 + np.sqrt(1 - abar) * model_noise
    pred = 0.7 * x_t - 0.4 * timesteps.reshape(-1, 1, 1, 1) / 1000.0
    target = noise if kind == "epsilon" else np.sqrt(abar) * noise - np.sqrt(1 - abar) * x0
    per_sample = np.mean((pred - target) ** 2, axis=(1, 2, 3))
    if cfg.snr_gamma is not None:
        snr = abar.ravel() / (1 - abar.ravel())
        base = np.minimum(snr, cfg.snr_gamma)
        per_sample = per_sample * (base / snr if kind == "epsilon" else base / (snr + 1))
    return float(np.mean(per_sample))


CASES = {
    "plain": ObjectiveSection(),
    "all-options": ObjectiveSection(noise_offset=0.1, snr_gamma=5.0, input_perturbation=0.1),
}


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_ddpm_loss_is_the_hand_computed_mse(kind, case):
    cfg = CASES[case]
    family = _family(kind)
    target = objective.training_target(family, cfg, "/pipeline")
    assert target.kind == kind  # the schedule's prediction_type, not family.objective
    batch, key = _batch(), jax.random.key(11)

    eager = objective.training_loss(family, None, PARAMS, batch, key, cfg, None, target)
    jitted = jax.jit(
        lambda p, b, k: objective.training_loss(family, None, p, b, k, cfg, None, target)
    )(PARAMS, batch, key)

    # the draws training_loss makes from its key, in its order
    key_t, key_noise, key_offset, key_perturb = jax.random.split(key, 4)
    timesteps = np.asarray(jax.random.randint(key_t, (SHAPE[0],), 0, 1000))
    noise = np.asarray(jax.random.normal(key_noise, SHAPE))
    offset = perturb = None
    if cfg.noise_offset:
        offset = np.asarray(jax.random.normal(key_offset, SHAPE[:2] + (1, 1)))
    if cfg.input_perturbation:
        perturb = np.asarray(jax.random.normal(key_perturb, SHAPE))
    expected = _by_hand(
        kind, target.schedule, batch["latents"], noise, timesteps, cfg, offset, perturb
    )
    assert float(eager) == pytest.approx(expected, rel=1e-5)
    assert float(jitted) == pytest.approx(expected, rel=1e-5)


def test_ddpm_gradient_is_finite_and_weights_matter():
    family = _family("v_prediction", rescale_betas_zero_snr=True)
    plain = objective.training_target(family, ObjectiveSection(), None)
    loss = lambda p, cfg: objective.training_loss(  # noqa: E731
        family, None, p, _batch(), jax.random.key(0), cfg, None, plain
    )
    grads = jax.grad(loss)(PARAMS, ObjectiveSection(snr_gamma=5.0))
    assert all(np.isfinite(float(g)) for g in grads.values())
    assert float(loss(PARAMS, ObjectiveSection(snr_gamma=1.0))) < float(
        loss(PARAMS, ObjectiveSection())
    )


@pytest.mark.parametrize("kind", ["epsilon", "v_prediction"])
def test_scoring_at_fixed_timesteps_is_the_same_formula(kind):
    family = _family(kind)
    target = objective.training_target(family, ObjectiveSection(), None)
    x0 = _batch()["latents"]
    timesteps = jnp.array([0, 250, 999, 1000], jnp.int32)  # 1000 is scored at 999
    ids = jnp.array([1, 2, 3, 4], jnp.uint32)
    got = scoring.per_record_loss(
        family, None, PARAMS, {"latents": x0}, timesteps, ids, 7, None, target
    )
    noise = np.asarray(scoring.record_noise(7, ids, SHAPE[1:]))
    for i, step in enumerate([0, 250, 999, 999]):
        expected = _by_hand(
            kind,
            target.schedule,
            x0[i : i + 1],
            noise[i : i + 1],
            np.array([step]),
            ObjectiveSection(),
        )
        assert float(got[i]) == pytest.approx(expected, rel=1e-5)


def _old_flow_loss(family, params, batch, key, cfg):
    """training_loss as it was before the DDPM objectives (flow matching only)."""
    latents = batch["latents"].astype(jnp.float32)
    key_t, key_noise = jax.random.split(key)
    t = objective.sample_t(key_t, latents.shape[0], cfg)
    noise = jax.random.normal(key_noise, latents.shape, jnp.float32)
    x_t = fm.add_noise(latents, noise, t, sigma_min=objective.SIGMA_MIN).astype(latents.dtype)
    pred = family.apply(None, params, x_t, t * 1000.0, {})
    per_sample = fm.flow_matching_loss(pred, noise - latents)[1]
    return jnp.mean(per_sample * objective.loss_weight(t, cfg))


@pytest.mark.parametrize("weighting", ["none", "gaussian"])
def test_flow_matching_is_unchanged(weighting):
    family = FakeFamily("flow_matching", hook=False)
    cfg = ObjectiveSection(loss_weighting=weighting)
    assert objective.training_target(family, cfg, "/pipeline") is objective.FLOW_TARGET
    batch, key = _batch(), jax.random.key(5)
    old = _old_flow_loss(family, PARAMS, batch, key, cfg)
    for target in (None, objective.FLOW_TARGET):
        new = objective.training_loss(family, None, PARAMS, batch, key, cfg, None, target)
        np.testing.assert_array_equal(np.asarray(new), np.asarray(old))
    timesteps, ids = jnp.array([0, 10, 500, 1000], jnp.int32), jnp.arange(4, dtype=jnp.uint32)
    noise = scoring.record_noise(3, ids, SHAPE[1:])
    old_score = objective.loss_at(
        family, None, PARAMS, batch["latents"], {}, timesteps.astype(jnp.float32) / 1000.0, noise
    )
    new_score = scoring.per_record_loss(family, None, PARAMS, batch, timesteps, ids, 3)
    np.testing.assert_array_equal(np.asarray(new_score), np.asarray(old_score))


@pytest.mark.parametrize("key", ["noise_offset", "snr_gamma", "input_perturbation"])
def test_ddpm_keys_are_refused_with_flow_matching(key):
    family = FakeFamily("flow_matching", hook=False)
    cfg = ObjectiveSection(**{key: 0.5})
    with pytest.raises(StageInputError, match=f"objective.{key}=0.5"):
        objective.training_target(family, cfg)
    with pytest.raises(StageInputError, match=f"objective.{key}"):
        objective.training_loss(family, None, PARAMS, _batch(), jax.random.key(0), cfg)


@pytest.mark.parametrize(
    ("cfg", "key"),
    [
        (ObjectiveSection(loss_weighting="gaussian"), "loss_weighting"),
        (ObjectiveSection(timestep_range=(0.0, 0.5)), "timestep_range"),
    ],
)
def test_flow_keys_are_refused_with_ddpm(cfg, key):
    with pytest.raises(StageInputError, match=f"objective.{key}"):
        objective.training_target(_family(), cfg)


def test_unknown_objective_is_refused_naming_it():
    family = FakeFamily("x0_prediction")
    for call in (
        lambda: objective.check_objective(family),
        lambda: objective.training_target(family, ObjectiveSection()),
        lambda: objective.training_loss(
            family, None, PARAMS, _batch(), jax.random.key(0), ObjectiveSection()
        ),
    ):
        with pytest.raises(StageInputError, match="'x0_prediction'"):
            call()
    with pytest.raises(StageInputError, match="'x0_prediction'"):
        TrainingTarget("x0_prediction")


def test_ddpm_without_a_schedule_is_refused():
    cfg = ObjectiveSection()
    with pytest.raises(StageInputError, match="noise schedule"):  # the family gives none
        objective.training_target(FakeFamily("epsilon", hook=False), cfg, "/p")
    with pytest.raises(StageInputError, match="noise schedule"):  # the loop passed none
        objective.training_loss(_family(), None, PARAMS, _batch(), jax.random.key(0), cfg)
    with pytest.raises(StageInputError, match="prediction_type='sample'"):
        objective.training_target(_family("sample"), cfg, "/p")
    with pytest.raises(StageInputError, match="unknown keys"):
        objective.training_target(_family(beta_typo=1), cfg, "/p")


def test_target_round_trips_through_a_manifest():
    target = objective.training_target(
        _family("v_prediction", rescale_betas_zero_snr=True), ObjectiveSection()
    )
    recorded = json.loads(json.dumps(target.to_dict()))
    assert recorded["objective"] == "v_prediction"
    assert TrainingTarget.from_dict(recorded) == target
    assert hash(TrainingTarget.from_dict(recorded)) == hash(target)  # static under jit
    assert TrainingTarget.from_dict(None) is objective.FLOW_TARGET  # older manifests
    flow = json.loads(json.dumps(objective.FLOW_TARGET.to_dict()))
    assert TrainingTarget.from_dict(flow) == objective.FLOW_TARGET


def test_section_checks_its_values():
    with pytest.raises(ValueError, match="snr_gamma"):
        ObjectiveSection(snr_gamma=0.0)
    with pytest.raises(ValueError, match="noise_offset"):
        ObjectiveSection(noise_offset=-0.1)
