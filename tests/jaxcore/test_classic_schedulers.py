"""Classic (DDPM-trained) samplers vs diffusers (PyTorch), step for step, in float32.

DDIM, Euler, Euler-ancestral and DPM-Solver(++) run against diffusers' ``DDIMScheduler``,
``EulerDiscreteScheduler``, ``EulerAncestralDiscreteScheduler`` and
``DPMSolverMultistepScheduler``, both driven as a diffusers pipeline drives them (latents =
noise * init_noise_sigma, model fed ``scale_model_input``) by the same deterministic fake model
``0.3 x + 0.1 sin(t / 100) + 0.1 tanh(A x)`` (numpy, fixed random ``A``), each integrating its
*own* trajectory. The stochastic samplers get the same per-step noise (diffusers' ``randn_tensor``
patched, or ``variance_noise``). Every intermediate sample is compared.

Schedules: integer timesteps are equal; sigmas and fractional timesteps agree to 1e-6 relative
(bit for bit except where PyTorch's float32 ``sqrt`` (MKL), not correctly rounded for ~0.7% of
inputs on this CPU, differs by an ulp); betas/alphas_cumprod are bit-exact without zero-SNR.

Tolerance: |ours - ref| <= 1e-6 * scale at every step, scale = the largest magnitude of
diffusers' samples so far (>= 1): the float32 rounding of the largest values a trajectory has
carried stays in it (zero-SNR Euler starts at sigma 4096 and cancels ~1e4-sized latents to O(1)
in its first step). Reached (CPU): DDIM 8.4e-7, Euler and Euler-ancestral 1.0e-7, DPM-Solver
4.7e-7 (SDE 6.1e-7), except three ill-conditioned DPM-Solver schedules (epsilon prediction at
alpha ~ 1e-4 with cosine betas or zero-SNR Karras sigmas; 3 beta sigmas, r0 = 1/8) at up to
3.1e-6, where diffusers itself moves as much under a one-ulp change of its initial latents: the
DPM-Solver variants may deviate by 4x that self-deviation (worst used: 0.43 of it). Under
``jax.jit`` XLA fuses ``a + b * c`` into FMAs and divides by scalars through a reciprocal; the
fori_loop test bounds that difference by the same 1e-6 of scale.
"""

from __future__ import annotations

import inspect

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    DDPMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)
from diffusers.schedulers import scheduling_euler_ancestral_discrete

from jaxcore.schedulers import classic, ddim, dpmsolver_multistep, euler_discrete
from jaxcore.schedulers.classic import ClassicConfigError

# diffusers warns that algorithm_type="dpmsolver" is deprecated; we test it all the same.
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated:FutureWarning")

SHAPE = (2, 4, 8, 8)
TOL = 1e-6

_rng = np.random.default_rng(2024)
A = _rng.standard_normal(SHAPE).astype(np.float32)
X_INIT = _rng.standard_normal(SHAPE).astype(np.float32)

# Stable Diffusion 2 base's scheduler_config.json (PNDM; pipelines swap in DDIM/Euler/DPM++).
SD2_CONFIG = {
    "_class_name": "PNDMScheduler",
    "_diffusers_version": "0.10.0.dev0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
# SDXL base's scheduler_config.json.
SDXL_CONFIG = {
    "_class_name": "EulerDiscreteScheduler",
    "_diffusers_version": "0.19.0.dev0",
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}
SD = {k: v for k, v in SD2_CONFIG.items() if not k.startswith("_") and k != "skip_prk_steps"}
SD_NOISE = {k: SD[k] for k in ("beta_start", "beta_end", "beta_schedule", "steps_offset")}


def fake_model(x: np.ndarray, t: float) -> np.ndarray:
    """Deterministic smooth stand-in for the denoiser (numpy, so both sides get equal outputs)."""
    return (0.3 * x + np.float32(0.1 * np.sin(t / 100.0)) + 0.1 * np.tanh(A * x)).astype(np.float32)


# ---------------------------------------------------------------- loops


def run_reference(
    scheduler, num_steps: int, noise=None, monkeypatch=None, x_init=X_INIT, **step_kwargs
):
    """diffusers' pipeline loop: ``[x_0, x_1, ..., x_N]`` as numpy arrays."""
    scheduler.set_timesteps(num_steps)
    if hasattr(scheduler, "set_begin_index"):
        # Start at step 0, as we do. Without it diffusers starts at the *second* occurrence of
        # the first timestep when that repeats (cosine betas with Karras sigmas) and then
        # steps past the end of its schedule (IndexError).
        scheduler.set_begin_index(0)
    if noise is not None and monkeypatch is not None:  # Euler-ancestral draws inside step()
        draws = iter(torch.from_numpy(n) for n in noise)
        monkeypatch.setattr(
            scheduling_euler_ancestral_discrete, "randn_tensor", lambda *a, **k: next(draws)
        )
    x = torch.from_numpy(x_init.copy()) * scheduler.init_noise_sigma
    samples = [x.numpy().copy()]
    for i, t in enumerate(scheduler.timesteps):
        model_input = scheduler.scale_model_input(x, t)
        output = torch.from_numpy(fake_model(model_input.numpy(), float(t)))
        kwargs = dict(step_kwargs)
        if noise is not None and monkeypatch is None:
            kwargs["variance_noise"] = torch.from_numpy(noise[i])
        x = scheduler.step(output, t, x, return_dict=False, **kwargs)[0]
        samples.append(x.numpy().copy())
    return samples


def run_ours(module, state, step_fn):
    """Our loop, un-jitted (one op at a time, as PyTorch): ``[x_0, ..., x_N]``."""
    x = jnp.asarray(X_INIT) * module.init_noise_sigma(state)
    samples = [np.asarray(x)]
    for t in np.asarray(state.timesteps):
        model_input = np.asarray(module.scale_model_input(state, x))
        x, state = step_fn(state, jnp.asarray(fake_model(model_input, float(t))), x)
        samples.append(np.asarray(x))
    return samples


def assert_trajectories_close(ours, reference, perturbed=None):
    """Each step within ``TOL`` times the largest magnitude of diffusers' samples so far (and
    at least 1): float32 rounding of the largest values a trajectory carried stays in it.

    ``perturbed``: diffusers' trajectory from initial latents moved by one ulp. Where that
    moves diffusers' own result by more (an ill-conditioned schedule), four times its deviation
    is allowed instead: we cannot be much closer to diffusers than diffusers is to itself.
    """
    assert len(ours) == len(reference)
    scale = 1.0
    for step, (got, want) in enumerate(zip(ours, reference, strict=True)):
        scale = max(scale, float(np.abs(want).max()))
        atol = TOL * scale
        if perturbed is not None:
            atol = max(atol, 4 * float(np.abs(perturbed[step] - want).max()))
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=f"step {step}")


def run_reference_perturbed(scheduler, num_steps: int, **kwargs):
    """:func:`run_reference` of a fresh copy of ``scheduler`` from latents one ulp away."""
    fresh = type(scheduler).from_config(scheduler.config)
    nudged = np.nextafter(X_INIT, np.float32(np.inf))
    return run_reference(fresh, num_steps, x_init=nudged, **kwargs)


# Zero-SNR rescaling takes float32 square roots of alphas a few ulp apart, and PyTorch's CPU
# sqrt / cumprod round differently by vector unit (bit-equal to ours on the Intel machines these
# tests were written on; on an AMD EPYC with AVX-512 the sigmas drift 1.8e-6, the timesteps
# interpolated through their logs 9.7e-6, the cumulative alphas near zero 7.4e-5 relative)
ZERO_SNR_RTOL = 3e-5


def assert_schedule_equal(state, reference):
    """Timesteps and sigmas as diffusers' (integers exact, floats to 1e-6 relative; to
    ZERO_SNR_RTOL with zero-SNR rescaling)."""
    rtol = ZERO_SNR_RTOL if getattr(reference.config, "rescale_betas_zero_snr", False) else 1e-6
    want_t = reference.timesteps.numpy()
    got_t = np.asarray(state.timesteps)
    if want_t.dtype.kind == "i":
        np.testing.assert_array_equal(got_t, want_t)
    else:
        np.testing.assert_allclose(got_t, want_t, rtol=rtol, atol=1e-6)
    if hasattr(state, "sigmas"):
        np.testing.assert_allclose(np.asarray(state.sigmas), reference.sigmas.numpy(), rtol=rtol)


def step_noise_for(num_steps: int) -> np.ndarray:
    return np.random.default_rng(num_steps).standard_normal((num_steps, *SHAPE), np.float32)


# ---------------------------------------------------------------- DDIM

DDIM_CASES = {
    "sd2": dict(SD),
    "sd2-v-trailing": dict(SD, prediction_type="v_prediction", timestep_spacing="trailing"),
    "sd2-v-linspace": dict(SD, prediction_type="v_prediction", timestep_spacing="linspace"),
    "sd2-eps-trailing": dict(SD, timestep_spacing="trailing"),
    "sd2-eps-linspace-offset0": dict(SD, timestep_spacing="linspace", steps_offset=0),
    "sd2-v-leading-offset0": dict(SD, prediction_type="v_prediction", steps_offset=0),
    "zero-snr-trailing-v": dict(
        SD, prediction_type="v_prediction", timestep_spacing="trailing", rescale_betas_zero_snr=True
    ),
    "zero-snr-leading-eps": dict(SD, rescale_betas_zero_snr=True),
    "alpha-to-one": dict(SD, set_alpha_to_one=True),
    "defaults-clip": {},  # linear betas, clip_sample=True, set_alpha_to_one=True
    "clip-range-v": dict(
        SD, clip_sample=True, clip_sample_range=0.5, prediction_type="v_prediction"
    ),
    "cosine-sample": dict(beta_schedule="squaredcos_cap_v2", prediction_type="sample"),
}


@pytest.mark.parametrize("num_steps", [1, 2, 7, 25, 50])
def test_ddim_sd2_matches_diffusers(num_steps):
    reference = DDIMScheduler.from_config(SD2_CONFIG)
    expected = run_reference(reference, num_steps)
    state = ddim.make_ddim(num_steps, SD2_CONFIG)
    assert_schedule_equal(state, reference)
    assert_trajectories_close(run_ours(ddim, state, ddim.ddim_step), expected)


@pytest.mark.parametrize("num_steps", [7, 25])
@pytest.mark.parametrize("case", sorted(DDIM_CASES))
def test_ddim_variants_match_diffusers(case, num_steps):
    config = DDIM_CASES[case]
    reference = DDIMScheduler(**config)
    expected = run_reference(reference, num_steps)
    state = ddim.make_ddim(num_steps, ddim.DDIMConfig(**config))
    assert_schedule_equal(state, reference)
    assert_trajectories_close(run_ours(ddim, state, ddim.ddim_step), expected)


@pytest.mark.parametrize(
    ("eta", "clipped"), [(1.0, False), (0.5, True)], ids=["eta1", "eta0.5-clipped-output"]
)
def test_ddim_eta_with_given_noise_matches_diffusers(eta, clipped):
    num_steps = 10
    config = dict(SD, clip_sample=True)
    noise = step_noise_for(num_steps)
    expected = run_reference(
        DDIMScheduler(**config), num_steps, noise, eta=eta, use_clipped_model_output=clipped
    )
    state = ddim.make_ddim(
        num_steps, config, eta=eta, use_clipped_model_output=clipped, noise=noise
    )
    assert_trajectories_close(run_ours(ddim, state, ddim.ddim_step), expected)


def test_ddim_trailing_61_steps_quirk_matches_diffusers():
    """diffusers' trailing ``arange`` gives 62 timesteps for 61 steps, the last one -1."""
    config = dict(SD, timestep_spacing="trailing", prediction_type="v_prediction")
    reference = DDIMScheduler(**config)
    expected = run_reference(reference, 61)
    state = ddim.make_ddim(61, config)
    assert state.num_inference_steps == 62 and int(state.timesteps[-1]) == -1
    assert_schedule_equal(state, reference)
    assert_trajectories_close(run_ours(ddim, state, ddim.ddim_step), expected)


# ---------------------------------------------------------------- Euler

EULER_CASES = {
    "sdxl-v": dict(SDXL_CONFIG, prediction_type="v_prediction"),
    "sdxl-trailing": dict(SDXL_CONFIG, timestep_spacing="trailing"),
    "sdxl-linspace-v": dict(
        SDXL_CONFIG, timestep_spacing="linspace", prediction_type="v_prediction"
    ),
    "sdxl-offset0": dict(SDXL_CONFIG, steps_offset=0),
    "karras": dict(SDXL_CONFIG, use_karras_sigmas=True),
    "karras-v-linspace-bounds": dict(
        SDXL_CONFIG,
        use_karras_sigmas=True,
        timestep_spacing="linspace",
        prediction_type="v_prediction",
        sigma_min=0.05,
        sigma_max=10.0,
    ),
    "exponential": dict(SDXL_CONFIG, use_exponential_sigmas=True),
    "beta": dict(SDXL_CONFIG, use_beta_sigmas=True, timestep_spacing="trailing"),
    "final-sigma-min": dict(SDXL_CONFIG, final_sigmas_type="sigma_min"),
    "log-linear": dict(SDXL_CONFIG, interpolation_type="log_linear"),
    "continuous-v": dict(SDXL_CONFIG, timestep_type="continuous", prediction_type="v_prediction"),
    "sample": dict(SDXL_CONFIG, prediction_type="sample"),
    "defaults-linear": {},
    "cosine-trailing": dict(beta_schedule="squaredcos_cap_v2", timestep_spacing="trailing"),
}
ZERO_SNR_EULER = {
    "zero-snr-trailing-v": dict(
        SDXL_CONFIG,
        timestep_spacing="trailing",
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
    ),
    "zero-snr-leading-eps": dict(SDXL_CONFIG, rescale_betas_zero_snr=True),
    "zero-snr-karras-v": dict(
        SDXL_CONFIG,
        use_karras_sigmas=True,
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
    ),
}


@pytest.mark.parametrize("num_steps", [1, 2, 7, 25, 50])
def test_euler_sdxl_matches_diffusers(num_steps):
    reference = EulerDiscreteScheduler.from_config(SDXL_CONFIG)
    expected = run_reference(reference, num_steps)
    state = euler_discrete.make_euler(num_steps, SDXL_CONFIG)
    assert_schedule_equal(state, reference)
    assert_trajectories_close(run_ours(euler_discrete, state, euler_discrete.euler_step), expected)


@pytest.mark.parametrize("num_steps", [7, 25])
@pytest.mark.parametrize("case", sorted(EULER_CASES) + sorted(ZERO_SNR_EULER))
def test_euler_variants_match_diffusers(case, num_steps):
    config = {**EULER_CASES, **ZERO_SNR_EULER}[case]
    reference = EulerDiscreteScheduler.from_config(config)
    expected = run_reference(reference, num_steps)
    state = euler_discrete.make_euler(num_steps, config)
    assert_schedule_equal(state, reference)
    ours = run_ours(euler_discrete, state, euler_discrete.euler_step)
    assert_trajectories_close(ours, expected)


def test_euler_trailing_61_steps_quirk_matches_diffusers():
    config = dict(SDXL_CONFIG, timestep_spacing="trailing")
    reference = EulerDiscreteScheduler.from_config(config)
    expected = run_reference(reference, 61)
    state = euler_discrete.make_euler(61, config)
    assert state.num_inference_steps == 62
    assert_schedule_equal(state, reference)
    assert_trajectories_close(run_ours(euler_discrete, state, euler_discrete.euler_step), expected)


ANCESTRAL_CASES = {
    "sdxl": dict(SDXL_CONFIG),
    "sdxl-v-trailing": dict(
        SDXL_CONFIG, prediction_type="v_prediction", timestep_spacing="trailing"
    ),
    "linspace-offset0": dict(SD_NOISE, timestep_spacing="linspace", steps_offset=0),
    "zero-snr-trailing-v": dict(
        SD_NOISE,
        timestep_spacing="trailing",
        prediction_type="v_prediction",
        rescale_betas_zero_snr=True,
    ),
    "cosine": dict(beta_schedule="squaredcos_cap_v2"),
}


@pytest.mark.parametrize("num_steps", [1, 7, 25])
@pytest.mark.parametrize("case", sorted(ANCESTRAL_CASES))
def test_euler_ancestral_matches_diffusers(case, num_steps, monkeypatch):
    config = ANCESTRAL_CASES[case]
    noise = step_noise_for(num_steps)
    reference = EulerAncestralDiscreteScheduler.from_config(config)
    expected = run_reference(reference, num_steps, noise, monkeypatch)
    state = euler_discrete.make_euler_ancestral(num_steps, config, noise=noise, sample_shape=SHAPE)
    assert_schedule_equal(state, reference)
    ours = run_ours(euler_discrete, state, euler_discrete.euler_ancestral_step)
    assert_trajectories_close(ours, expected)


# ---------------------------------------------------------------- DPM-Solver

DPM_SD = {k: v for k, v in SD.items() if k not in ("clip_sample", "set_alpha_to_one")}
DPM_CASES = {
    "order1": dict(DPM_SD, solver_order=1),
    "order3": dict(DPM_SD, solver_order=3),
    "heun": dict(DPM_SD, solver_type="heun"),
    "order3-heun-v": dict(
        DPM_SD, solver_order=3, solver_type="heun", prediction_type="v_prediction"
    ),
    "v-trailing": dict(DPM_SD, prediction_type="v_prediction", timestep_spacing="trailing"),
    "leading": dict(DPM_SD, timestep_spacing="leading"),
    "sample": dict(DPM_SD, prediction_type="sample", timestep_spacing="trailing"),
    "karras": dict(DPM_SD, use_karras_sigmas=True),
    "karras-order3-v": dict(
        DPM_SD, use_karras_sigmas=True, solver_order=3, prediction_type="v_prediction"
    ),
    "lu-lambdas": dict(DPM_SD, use_lu_lambdas=True),
    "exponential": dict(DPM_SD, use_exponential_sigmas=True),
    "beta": dict(DPM_SD, use_beta_sigmas=True),
    "sigma-min-no-lower-order-final": dict(
        DPM_SD, final_sigmas_type="sigma_min", lower_order_final=False
    ),
    "sigma-min-order3-euler-at-final": dict(
        DPM_SD, final_sigmas_type="sigma_min", solver_order=3, euler_at_final=True
    ),
    "no-lower-order-final-zero": dict(DPM_SD, lower_order_final=False, solver_order=3),
    "dpmsolver-midpoint": dict(DPM_SD, algorithm_type="dpmsolver", final_sigmas_type="sigma_min"),
    "dpmsolver-order3-v": dict(
        DPM_SD,
        algorithm_type="dpmsolver",
        final_sigmas_type="sigma_min",
        solver_order=3,
        prediction_type="v_prediction",
    ),
    "dpmsolver-heun-sample": dict(
        DPM_SD,
        algorithm_type="dpmsolver",
        final_sigmas_type="sigma_min",
        solver_type="heun",
        prediction_type="sample",
        lower_order_final=False,
    ),
    "zero-snr-trailing-v": dict(
        DPM_SD,
        rescale_betas_zero_snr=True,
        timestep_spacing="trailing",
        prediction_type="v_prediction",
    ),
    "zero-snr-leading-karras": dict(
        DPM_SD, rescale_betas_zero_snr=True, timestep_spacing="leading", use_karras_sigmas=True
    ),
    "lambda-min-clipped": dict(DPM_SD, lambda_min_clipped=-2.5),
    "cosine-karras": dict(beta_schedule="squaredcos_cap_v2", use_karras_sigmas=True),
    "defaults-linear": {},
}


@pytest.mark.parametrize("num_steps", [1, 2, 7, 25, 50])
def test_dpmsolver_sd2_matches_diffusers(num_steps):
    reference = DPMSolverMultistepScheduler.from_config(SD2_CONFIG)
    expected = run_reference(reference, num_steps)
    state = dpmsolver_multistep.make_dpmsolver(num_steps, SD2_CONFIG, sample_shape=SHAPE)
    assert_schedule_equal(state, reference)
    ours = run_ours(dpmsolver_multistep, state, dpmsolver_multistep.dpmsolver_step)
    assert_trajectories_close(ours, expected)


@pytest.mark.parametrize("num_steps", [3, 7, 20])
@pytest.mark.parametrize("case", sorted(DPM_CASES))
def test_dpmsolver_variants_match_diffusers(case, num_steps):
    config = DPM_CASES[case]
    reference = DPMSolverMultistepScheduler(**config)
    expected = run_reference(reference, num_steps)
    state = dpmsolver_multistep.make_dpmsolver(num_steps, config)  # history allocated lazily
    assert_schedule_equal(state, reference)
    ours = run_ours(dpmsolver_multistep, state, dpmsolver_multistep.dpmsolver_step)
    # Some of these schedules amplify rounding (epsilon prediction at alpha ~ 1e-4 with cosine
    # betas or zero-SNR Karras sigmas; r0 = 1/8 with 3 beta sigmas): diffusers moves by up to
    # 3e-6 of the sample scale under a one-ulp change of its input, and so do we (see top).
    assert_trajectories_close(ours, expected, run_reference_perturbed(reference, num_steps))


@pytest.mark.parametrize("num_steps", [1, 7, 25])
@pytest.mark.parametrize(
    "config",
    [
        dict(DPM_SD, algorithm_type="sde-dpmsolver++"),
        dict(DPM_SD, algorithm_type="sde-dpmsolver++", use_karras_sigmas=True, solver_order=3),
        dict(
            DPM_SD,
            algorithm_type="sde-dpmsolver++",
            solver_type="heun",
            prediction_type="v_prediction",
        ),
    ],
    ids=["midpoint", "karras-order3", "heun-v"],
)
def test_sde_dpmsolver_with_given_noise_matches_diffusers(config, num_steps):
    noise = step_noise_for(num_steps)
    reference = DPMSolverMultistepScheduler(**config)
    expected = run_reference(reference, num_steps, noise)
    state = dpmsolver_multistep.make_dpmsolver(num_steps, config, noise=noise, sample_shape=SHAPE)
    ours = run_ours(dpmsolver_multistep, state, dpmsolver_multistep.dpmsolver_step)
    assert_trajectories_close(ours, expected)


def test_dpmsolver_orders_follow_diffusers():
    config = dpmsolver_multistep.DPMSolverConfig(solver_order=3)
    np.testing.assert_array_equal(dpmsolver_multistep.step_orders(config, 5), [1, 2, 3, 2, 1])
    np.testing.assert_array_equal(
        dpmsolver_multistep.step_orders(config, 16), [1, 2] + [3] * 13 + [1]
    )
    euler_final = dpmsolver_multistep.DPMSolverConfig(
        final_sigmas_type="sigma_min", lower_order_final=False, euler_at_final=True
    )
    np.testing.assert_array_equal(dpmsolver_multistep.step_orders(euler_final, 4), [1, 2, 2, 1])


# ---------------------------------------------------------------- jit / fori_loop


def _jnp_model(x, t):
    return 0.3 * x + 0.1 * jnp.sin(t / 100.0) + 0.1 * jnp.tanh(jnp.asarray(A) * x)


def _fori_loop_samples(module, state, step_fn):
    """The whole loop in one ``jax.jit(lax.fori_loop)`` with the step index traced."""

    def body(i, carry):
        x, st = carry
        t = st.timesteps[i].astype(jnp.float32)
        out = _jnp_model(module.scale_model_input(st, x), t)
        return step_fn(st, out, x)

    @jax.jit
    def sample(st, x):
        return jax.lax.fori_loop(0, st.timesteps.shape[0], body, (x, st))

    x0 = jnp.asarray(X_INIT) * module.init_noise_sigma(state)
    return sample(state, x0)


def _python_loop_final(module, state, step_fn):
    x = jnp.asarray(X_INIT) * module.init_noise_sigma(state)
    for i in range(state.timesteps.shape[0]):
        t = state.timesteps[i].astype(jnp.float32)
        x, state = step_fn(state, _jnp_model(module.scale_model_input(state, x), t), x)
    return x, state


@pytest.mark.parametrize(
    "name",
    ["ddim-eta", "euler-karras-v", "euler-ancestral", "dpmsolver-order3", "sde-dpmsolver-heun"],
)
def test_fori_loop_equals_python_loop(name):
    num_steps = 12
    noise = step_noise_for(num_steps)
    module, step_fn, state = {
        "ddim-eta": (
            ddim,
            ddim.ddim_step,
            lambda: ddim.make_ddim(num_steps, SD, eta=1.0, noise=noise),
        ),
        "euler-karras-v": (
            euler_discrete,
            euler_discrete.euler_step,
            lambda: euler_discrete.make_euler(num_steps, EULER_CASES["karras-v-linspace-bounds"]),
        ),
        "euler-ancestral": (
            euler_discrete,
            euler_discrete.euler_ancestral_step,
            lambda: euler_discrete.make_euler_ancestral(num_steps, SDXL_CONFIG, noise=noise),
        ),
        "dpmsolver-order3": (
            dpmsolver_multistep,
            dpmsolver_multistep.dpmsolver_step,
            lambda: dpmsolver_multistep.make_dpmsolver(
                num_steps, DPM_CASES["karras-order3-v"], sample_shape=SHAPE
            ),
        ),
        "sde-dpmsolver-heun": (
            dpmsolver_multistep,
            dpmsolver_multistep.dpmsolver_step,
            lambda: dpmsolver_multistep.make_dpmsolver(
                num_steps,
                dict(DPM_SD, algorithm_type="sde-dpmsolver++", solver_type="heun"),
                noise=noise,
                sample_shape=SHAPE,
            ),
        ),
    }[name]
    jitted, final_state = _fori_loop_samples(module, state(), step_fn)
    eager, _ = _python_loop_final(module, state(), step_fn)
    assert int(final_state.step_index) == num_steps
    scale = max(1.0, float(jnp.abs(eager).max()))
    np.testing.assert_allclose(jitted, eager, rtol=0, atol=TOL * scale)


# ---------------------------------------------------------------- configuration


def test_from_config_of_sd2_ddim_config_matches_diffusers():
    """SD 2's config through ``DDIMScheduler.from_config``, then that config into Euler and
    DPM-Solver (diffusers' ``_use_default_values`` make the targets' defaults apply)."""
    reference_ddim = DDIMScheduler.from_config(SD2_CONFIG)
    ddim_config = dict(reference_ddim.config)
    for cls, make in [
        (EulerDiscreteScheduler, euler_discrete.make_euler),
        (EulerAncestralDiscreteScheduler, None),
        (DPMSolverMultistepScheduler, dpmsolver_multistep.make_dpmsolver),
        (DDIMScheduler, ddim.make_ddim),
    ]:
        for source in (ddim_config, SD2_CONFIG):
            reference = cls.from_config(source)
            reference.set_timesteps(20)
            if make is None:
                state = euler_discrete.make_euler_ancestral(20, source, noise=step_noise_for(20))
            else:
                state = make(20, source)
            assert_schedule_equal(state, reference)
    assert euler_discrete.make_euler(20, ddim_config).initial_sigma == pytest.approx(
        float(EulerDiscreteScheduler.from_config(ddim_config).init_noise_sigma), rel=1e-6
    )


def test_read_config_reads_what_each_scheduler_reads():
    euler = classic.read_config(euler_discrete.EulerConfig, SDXL_CONFIG, "sdxl")
    assert euler.timestep_spacing == "leading" and euler.steps_offset == 1
    dpm = classic.read_config(dpmsolver_multistep.DPMSolverConfig, SD2_CONFIG)
    assert dpm.timestep_spacing == "linspace"  # DPM's default; SD 2's config has none
    ddim_config = classic.read_config(ddim.DDIMConfig, SD2_CONFIG)
    assert ddim_config.timestep_spacing == "leading" and not ddim_config.set_alpha_to_one
    # diffusers rewrites DEIS / UniPC names when building DPM-Solver.
    deis = classic.read_config(
        dpmsolver_multistep.DPMSolverConfig, {"algorithm_type": "deis", "solver_type": "logrho"}
    )
    assert (deis.algorithm_type, deis.solver_type) == ("dpmsolver++", "midpoint")


@pytest.mark.parametrize(
    ("cls", "config", "message"),
    [
        (ddim.DDIMConfig, dict(SD, timestep_spcing="leading"), "timestep_spcing"),
        (ddim.DDIMConfig, dict(SD, thresholding=True), "thresholding=True"),
        (ddim.DDIMConfig, dict(SD, beta_schedule="sigmoid"), "beta_schedule='sigmoid'"),
        (ddim.DDIMConfig, dict(SD, steps_offset="1"), "steps_offset='1'"),
        (ddim.DDIMConfig, dict(SD, trained_betas=[0.1, 0.2]), "trained_betas"),
        (euler_discrete.EulerConfig, dict(SD, timestep_spacing="even"), "timestep_spacing='even'"),
        (euler_discrete.EulerConfig, dict(SD, interpolation_type="cubic"), "interpolation_type"),
        (
            euler_discrete.EulerConfig,
            dict(SD, use_karras_sigmas=True, use_beta_sigmas=True),
            "use_karras_sigmas and use_beta_sigmas",
        ),
        (euler_discrete.EulerAncestralConfig, dict(SD, prediction_type="sample"), "'sample'"),
        (dpmsolver_multistep.DPMSolverConfig, dict(SD, solver_order=4), "solver_order=4"),
        (
            dpmsolver_multistep.DPMSolverConfig,
            dict(SD, prediction_type="flow_prediction"),
            "flow_prediction",
        ),
        (
            dpmsolver_multistep.DPMSolverConfig,
            dict(SD, algorithm_type="dpmsolver"),
            "final_sigmas_type='zero'",
        ),
        (
            dpmsolver_multistep.DPMSolverConfig,
            dict(SD, algorithm_type="sde-dpmsolver"),
            "sde-dpmsolver",
        ),
        (
            dpmsolver_multistep.DPMSolverConfig,
            dict(SD, use_flow_sigmas=True),
            "use_flow_sigmas=True",
        ),
        (
            dpmsolver_multistep.DPMSolverConfig,
            dict(SD, variance_type="learned_range"),
            "variance_type",
        ),
        (
            dpmsolver_multistep.DPMSolverConfig,
            dict(SD, _class_name="FlowMatchEulerDiscreteScheduler"),
            "flow-matching",
        ),
    ],
)
def test_refused_configs_name_the_key(cls, config, message):
    with pytest.raises(ClassicConfigError, match=message.replace("(", r"\(")):
        classic.read_config(cls, config, "scheduler_config.json")


def test_known_keys_cover_every_diffusers_scheduler():
    """Every config key of every installed diffusers scheduler is known (so a key of another
    scheduler is ignored, never reported as unknown)."""
    missing = set()
    for name in dir(diffusers):
        if not name.endswith("Scheduler") or name.startswith("Flax"):
            continue  # (getattr would import every pipeline)
        keys = set(inspect.signature(getattr(diffusers, name).__init__).parameters)
        missing |= keys - {"self", "args", "kwargs"} - classic.DIFFUSERS_SCHEDULER_KEYS
    assert not missing


def test_trained_betas_match_diffusers():
    trained = np.linspace(1e-4, 0.03, 1000).tolist()
    config = dict(trained_betas=trained, prediction_type="v_prediction")
    reference = DDIMScheduler(**config)
    expected = run_reference(reference, 10)
    state = ddim.make_ddim(10, config)
    assert_trajectories_close(run_ours(ddim, state, ddim.ddim_step), expected)


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("schedule", ["scaled_linear", "linear", "squaredcos_cap_v2"])
def test_noise_schedule_matches_diffusers(schedule, rescale):
    """Bit for bit, except that zero-SNR rescaling takes square roots, which PyTorch's float32
    CPU ``sqrt`` rounds differently from IEEE for a few values (alphas a few ulp apart), by
    vector unit (see ZERO_SNR_RTOL: 2.9e-6 absolute on the betas on an AMD EPYC)."""
    reference = DDPMScheduler(beta_schedule=schedule, rescale_betas_zero_snr=rescale)
    config = classic.NoiseScheduleConfig(beta_schedule=schedule, rescale_betas_zero_snr=rescale)
    got_betas, got_cumprod = classic.betas(config), classic.alphas_cumprod(config)
    if rescale:
        np.testing.assert_allclose(got_betas, reference.betas.numpy(), rtol=0, atol=5e-6)
        np.testing.assert_allclose(
            got_cumprod, reference.alphas_cumprod.numpy(), rtol=10 * ZERO_SNR_RTOL
        )
        assert got_cumprod[-1] == 0 == reference.alphas_cumprod[-1]
    else:
        np.testing.assert_array_equal(got_betas, reference.betas.numpy())
        np.testing.assert_array_equal(got_cumprod, reference.alphas_cumprod.numpy())


# ---------------------------------------------------------------- training objective


@pytest.mark.parametrize("rescale", [False, True])
def test_add_noise_and_velocity_match_ddpm(rescale):
    config = classic.NoiseScheduleConfig(**SD_NOISE, rescale_betas_zero_snr=rescale)
    reference = DDPMScheduler(**SD_NOISE, rescale_betas_zero_snr=rescale)
    timesteps = np.array([0, 999], np.int64)
    clean = torch.from_numpy(A[:2])
    noise = torch.from_numpy(X_INIT[:2])
    noisy = jax.jit(classic.add_noise, static_argnums=0)(config, A[:2], X_INIT[:2], timesteps)
    target = jax.jit(classic.velocity, static_argnums=0)(config, A[:2], X_INIT[:2], timesteps)
    want_noisy = reference.add_noise(clean, noise, torch.from_numpy(timesteps)).numpy()
    want_target = reference.get_velocity(clean, noise, torch.from_numpy(timesteps)).numpy()
    np.testing.assert_allclose(noisy, want_noisy, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(target, want_target, rtol=1e-6, atol=1e-6)
    if rescale:  # zero terminal SNR: pure noise at t = 999, and v = -x0 there
        np.testing.assert_array_equal(noisy[1], X_INIT[1])


# ---------------------------------------------------------------- step noise


def test_step_noise_is_per_prompt_and_independent_of_the_batch():
    both = classic.step_noise([3, 7], 4, (4, 8, 8))
    alone = classic.step_noise([7], 4, (4, 8, 8))
    assert both.shape == (4, 2, 4, 8, 8) and both.dtype == np.float32
    np.testing.assert_array_equal(both[:, 1], alone[:, 0])
    assert not np.array_equal(both[:, 0], both[:, 1])
    # A stream of its own: not the initial latents of the same seed.
    initial = np.random.Generator(np.random.PCG64(7)).standard_normal((4, 8, 8), np.float32)
    assert not np.array_equal(alone[0, 0], initial)
    state = euler_discrete.make_euler_ancestral(
        4, SDXL_CONFIG, seeds=[3, 7], sample_shape=(2, 4, 8, 8)
    )
    np.testing.assert_array_equal(state.step_noise, both)


def test_stochastic_samplers_need_their_noise():
    with pytest.raises(ValueError, match="exactly one of noise"):
        euler_discrete.make_euler_ancestral(4, SDXL_CONFIG)
    with pytest.raises(ValueError, match="steps"):
        euler_discrete.make_euler_ancestral(4, SDXL_CONFIG, noise=step_noise_for(3))
    with pytest.raises(ValueError, match="only used"):
        dpmsolver_multistep.make_dpmsolver(4, SD2_CONFIG, noise=step_noise_for(4))
