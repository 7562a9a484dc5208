"""Flow Euler with scheduler_config.json options (Flux, SD3, ...) vs diffusers, in float32.

The reference is diffusers ``FlowMatchEulerDiscreteScheduler`` driven the way FluxPipeline
drives it: ``sigmas = linspace(1, 1/N, N)``, ``mu = calculate_shift(image_seq_len, ...)`` from
the scheduler config, ``retrieve_timesteps(scheduler, N, sigmas=sigmas, mu=mu)``,
``set_begin_index(0)``. Trajectories use the same deterministic fake model as
test_schedulers.py, ``v = tanh(x * A) + B * t / 1000``, each side integrating its own samples.

Tolerances reached (CPU): every schedule (sigmas and timesteps) is bit-identical to diffusers
(asserted with ``array_equal``; Flux-dev over image_seq_len 256/700/1024/4096/8192 and 1/4/28/50
steps, schnell, static shift, linear time shift, shift_terminal, invert_sigmas, Karras,
exponential and beta sigmas); ``calculate_shift`` is bit-identical to FluxPipeline's. The 4-step
Euler runs (28 configurations) agree to a max abs error of 4.8e-7 (one float32 ulp) on samples
of magnitude <= 3.9, i.e. <= 1.7e-7 relative to the sample scale; asserted
``|ours - ref| <= 1e-6 * max(1, max|ref|)`` per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as flux_calculate_shift
from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

from jaxcore import schedulers
from jaxcore.schedulers import flow_euler

# black-forest-labs/FLUX.1-dev and FLUX.1-schnell scheduler/scheduler_config.json.
FLUX_DEV = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.30.0.dev0",
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}
FLUX_SCHNELL = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.30.0.dev0",
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
}
IMAGE_SEQ_LENS = (256, 1024, 4096, 700, 8192)
FLUX_STEPS = (1, 4, 28, 50)
WHERE = "FLUX.1-dev/scheduler/scheduler_config.json"

SHAPE = (2, 16, 6)  # [B, L, C] like Flux's packed latents, tiny
TOL = 1e-6  # relative to the sample's scale, see assert_trajectories_close

_rng = np.random.default_rng(4321)
A = _rng.standard_normal(SHAPE).astype(np.float32)
B = _rng.standard_normal(SHAPE).astype(np.float32)
X_INIT = _rng.standard_normal(SHAPE).astype(np.float32)

_euler_step = jax.jit(flow_euler.flow_euler_step)  # one compile per schedule length


def fake_velocity(x, t):
    """Deterministic stand-in for the model, written for numpy and jax arrays alike."""
    xp = jnp if isinstance(x, jax.Array) else np
    return xp.tanh(x * A) + B * (t / 1000.0)


def config_without_bookkeeping(config: dict) -> dict:
    return {key: value for key, value in config.items() if not key.startswith("_")}


def reference_scheduler(config: dict, num_steps: int, sigmas=None, mu=None):
    """diffusers' scheduler after ``set_timesteps`` exactly as FluxPipeline calls it."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    if sigmas is None:
        retrieve_timesteps(scheduler, num_steps, mu=mu)
    else:
        retrieve_timesteps(scheduler, num_steps, sigmas=sigmas, mu=mu)
    scheduler.set_begin_index(0)
    return scheduler


def reference_mu(scheduler, image_seq_len: int) -> float:
    """FluxPipeline's ``mu`` from the scheduler config (the pipeline's own function)."""
    return flux_calculate_shift(
        image_seq_len,
        scheduler.config.get("base_image_seq_len", 256),
        scheduler.config.get("max_image_seq_len", 4096),
        scheduler.config.get("base_shift", 0.5),
        scheduler.config.get("max_shift", 1.15),
    )


def flux_pipeline_sigmas(num_steps: int) -> np.ndarray:
    """FluxPipeline.__call__'s default ``sigmas``."""
    return np.linspace(1.0, 1 / num_steps, num_steps)


def assert_schedule_identical(state, reference):
    sigmas, timesteps = np.asarray(state.sigmas), np.asarray(state.timesteps)
    assert sigmas.dtype == np.float32 and timesteps.dtype == np.float32
    np.testing.assert_array_equal(sigmas, reference.sigmas.numpy())
    np.testing.assert_array_equal(timesteps, reference.timesteps.numpy())


def run_reference(scheduler) -> list[np.ndarray]:
    x = torch.from_numpy(X_INIT.copy())
    samples = []
    for t in scheduler.timesteps:
        v = torch.from_numpy(fake_velocity(x.numpy(), float(t)))
        x = scheduler.step(v, t, x, return_dict=False)[0]
        samples.append(x.numpy().copy())
    return samples


def run_ours(state) -> list[np.ndarray]:
    x = jnp.asarray(X_INIT)
    samples = []
    for t in np.asarray(state.timesteps):
        x, state = _euler_step(state, fake_velocity(x, float(t)), x)
        samples.append(np.asarray(x))
    return samples


def assert_trajectories_close(ours, reference):
    """Every step within ``TOL`` relative to that step's scale ``max(1, max|reference|)``."""
    assert len(ours) == len(reference)
    for step, (got, want) in enumerate(zip(ours, reference, strict=True)):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL * scale, err_msg=f"step {step}")


# ---------------------------------------------------------------- Flux's sigmas and mu


@pytest.mark.parametrize("image_seq_len", (*IMAGE_SEQ_LENS, 1, 64, 4095, 16384))
def test_calculate_shift_equals_flux_pipeline(image_seq_len):
    assert flow_euler.calculate_shift(image_seq_len) == flux_calculate_shift(image_seq_len)
    line = (128, 2048, 0.3, 1.7)
    ours = flow_euler.calculate_shift(image_seq_len, *line)
    assert ours == flux_calculate_shift(image_seq_len, *line)
    options = flow_euler.flow_euler_options(FLUX_DEV, WHERE)
    reference = FlowMatchEulerDiscreteScheduler.from_config(FLUX_DEV)
    assert flow_euler.shift_mu(options, image_seq_len) == reference_mu(reference, image_seq_len)


@pytest.mark.parametrize("num_steps", FLUX_STEPS)
def test_flux_sigmas_are_the_pipeline_default(num_steps):
    sigmas = flow_euler.pipeline_sigmas(num_steps)
    assert sigmas.dtype == np.float64
    np.testing.assert_array_equal(sigmas, flux_pipeline_sigmas(num_steps))


# ---------------------------------------------------------------- FLUX.1-dev and schnell


@pytest.mark.parametrize("num_steps", FLUX_STEPS)
@pytest.mark.parametrize("image_seq_len", IMAGE_SEQ_LENS)
def test_flux_dev_schedule_is_bit_identical(image_seq_len, num_steps):
    options = flow_euler.flow_euler_options(FLUX_DEV, WHERE)
    reference = FlowMatchEulerDiscreteScheduler.from_config(FLUX_DEV)
    mu = reference_mu(reference, image_seq_len)
    reference = reference_scheduler(FLUX_DEV, num_steps, flux_pipeline_sigmas(num_steps), mu)
    state = flow_euler.make_flow_euler_from_options(
        options,
        num_steps,
        sigmas=flow_euler.pipeline_sigmas(num_steps),
        mu=flow_euler.shift_mu(options, image_seq_len),
    )
    assert_schedule_identical(state, reference)
    assert state.num_inference_steps == num_steps


@pytest.mark.parametrize("image_seq_len", IMAGE_SEQ_LENS)
def test_flux_dev_four_step_run_matches(image_seq_len):
    options = flow_euler.flow_euler_options(FLUX_DEV, WHERE)
    mu = flow_euler.shift_mu(options, image_seq_len)
    reference = reference_scheduler(FLUX_DEV, 4, flux_pipeline_sigmas(4), mu)
    state = flow_euler.make_flow_euler_from_options(
        options, 4, sigmas=flow_euler.pipeline_sigmas(4), mu=mu
    )
    assert_trajectories_close(run_ours(state), run_reference(reference))


@pytest.mark.parametrize("num_steps", (1, 4))
def test_flux_schnell_schedule_and_run_match(num_steps):
    """schnell: static shift 1, FluxPipeline's sigmas; the pipeline's mu is passed and ignored."""
    options = flow_euler.flow_euler_options(FLUX_SCHNELL, "FLUX.1-schnell/scheduler")
    mu = flow_euler.shift_mu(options, 4096)
    reference = reference_scheduler(FLUX_SCHNELL, num_steps, flux_pipeline_sigmas(num_steps), mu)
    state = flow_euler.make_flow_euler_from_options(
        options, num_steps, sigmas=flow_euler.pipeline_sigmas(num_steps), mu=mu
    )
    assert_schedule_identical(state, reference)
    assert_trajectories_close(run_ours(state), run_reference(reference))


# ---------------------------------------------------------------- other configurations

# (name, config, pass FluxPipeline's sigmas?, mu). Each is checked at 1, 4, 28 and 50 steps.
VARIANTS = [
    ("sd3_static_shift", {"num_train_timesteps": 1000, "shift": 3.0}, False, None),
    ("static_shift_1.7_T777", {"num_train_timesteps": 777, "shift": 1.7}, False, None),
    ("static_shift_with_sigmas", {"shift": 3.0}, True, None),
    ("dynamic_without_sigmas", {**FLUX_DEV}, False, 0.93),
    ("linear", {**FLUX_DEV, "time_shift_type": "linear"}, True, 1.15),
    ("linear_without_sigmas", {**FLUX_DEV, "time_shift_type": "linear"}, False, 0.7),
    ("shift_terminal", {**FLUX_DEV, "shift_terminal": 0.1}, True, 0.8),
    ("shift_terminal_static", {"shift": 3.0, "shift_terminal": 0.02}, False, None),
    ("invert_sigmas", {**FLUX_DEV, "invert_sigmas": True}, True, 1.15),
    ("invert_sigmas_static", {"shift": 3.0, "invert_sigmas": True}, False, None),
    ("karras", {**FLUX_DEV, "use_karras_sigmas": True}, True, 0.8),
    ("karras_static", {"shift": 3.0, "use_karras_sigmas": True}, False, None),
    ("exponential", {**FLUX_DEV, "use_exponential_sigmas": True}, True, 0.8),
    ("exponential_static", {"shift": 3.0, "use_exponential_sigmas": True}, False, None),
    ("beta", {**FLUX_DEV, "use_beta_sigmas": True}, True, 0.8),
    ("beta_static", {"shift": 3.0, "use_beta_sigmas": True}, False, None),
]


def _variant(config, with_sigmas, mu, num_steps):
    """(our state, diffusers' scheduler) for one variant at ``num_steps``."""
    sigmas = flux_pipeline_sigmas(num_steps) if with_sigmas else None
    options = flow_euler.flow_euler_options(config, "variant")
    state = flow_euler.make_flow_euler_from_options(options, num_steps, sigmas=sigmas, mu=mu)
    return state, reference_scheduler(config, num_steps, sigmas, mu)


def _skip_degenerate(config, num_steps):
    if config.get("shift_terminal") and num_steps == 1:
        pytest.skip("one step from sigma 1 cannot be stretched; see test_shift_terminal_one_step")


@pytest.mark.parametrize("num_steps", FLUX_STEPS)
@pytest.mark.parametrize(
    "config, with_sigmas, mu", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS]
)
def test_variant_schedule_is_bit_identical(config, with_sigmas, mu, num_steps):
    _skip_degenerate(config, num_steps)
    state, reference = _variant(config, with_sigmas, mu, num_steps)
    assert_schedule_identical(state, reference)


@pytest.mark.parametrize(
    "config, with_sigmas, mu", [v[1:] for v in VARIANTS], ids=[v[0] for v in VARIANTS]
)
def test_variant_four_step_run_matches(config, with_sigmas, mu):
    state, reference = _variant(config, with_sigmas, mu, 4)
    assert_trajectories_close(run_ours(state), run_reference(reference))


def test_invert_sigmas_ends_at_one():
    state, _ = _variant({**FLUX_DEV, "invert_sigmas": True}, True, 1.15, 4)
    sigmas = np.asarray(state.sigmas)
    assert sigmas[-1] == 1.0 and np.all(np.diff(sigmas) > 0)
    np.testing.assert_array_equal(np.asarray(state.timesteps), sigmas[:-1] * np.float32(1000))


def test_num_inference_steps_may_come_from_sigmas():
    options = flow_euler.flow_euler_options(FLUX_DEV, WHERE)
    given = flow_euler.flow_euler_schedule(options, 28, sigmas=flux_pipeline_sigmas(28), mu=0.9)
    implied = flow_euler.flow_euler_schedule(options, sigmas=flux_pipeline_sigmas(28), mu=0.9)
    for a, b in zip(given, implied, strict=True):
        np.testing.assert_array_equal(a, b)


def test_static_options_equal_make_flow_euler():
    """The options path with defaults is the historical make_flow_euler, bit for bit."""
    for shift in (1.0, 3.0, 5.0):
        old = flow_euler.make_flow_euler(28, shift=shift)
        new = flow_euler.make_flow_euler_from_options(flow_euler.FlowEulerOptions(shift=shift), 28)
        np.testing.assert_array_equal(np.asarray(old.sigmas), np.asarray(new.sigmas))
        np.testing.assert_array_equal(np.asarray(old.timesteps), np.asarray(new.timesteps))


# ---------------------------------------------------------------- the registry


def test_make_scheduler_passes_flux_options_through():
    options = flow_euler.flow_euler_options(FLUX_DEV, WHERE)
    mu = flow_euler.shift_mu(options, 1024)
    sigmas = flow_euler.pipeline_sigmas(28)
    state, step_fn = schedulers.make_scheduler(
        "flow_euler", 28, 3.0, euler_options=options, sigmas=sigmas, mu=mu
    )
    direct = flow_euler.make_flow_euler_from_options(options, 28, sigmas=sigmas, mu=mu)
    np.testing.assert_array_equal(np.asarray(state.sigmas), np.asarray(direct.sigmas))
    np.testing.assert_array_equal(np.asarray(state.timesteps), np.asarray(direct.timesteps))
    x = jnp.asarray(X_INIT)
    np.testing.assert_array_equal(
        step_fn(state, x, x)[0], flow_euler.flow_euler_step(state, x, x)[0]
    )
    # shift replaces the options' static shift; sigmas/mu alone build default options.
    static, _ = schedulers.make_scheduler(
        "flow_euler", 4, 5.0, euler_options=flow_euler.FlowEulerOptions()
    )
    np.testing.assert_array_equal(
        np.asarray(static.sigmas), np.asarray(flow_euler.make_flow_euler(4, 5.0).sigmas)
    )
    with_sigmas, _ = schedulers.make_scheduler("flow_euler", 4, 3.0, sigmas=flux_pipeline_sigmas(4))
    reference = reference_scheduler({"shift": 3.0}, 4, flux_pipeline_sigmas(4))
    assert_schedule_identical(with_sigmas, reference)
    with pytest.raises(TypeError, match="either euler_options"):
        schedulers.make_scheduler(
            "flow_euler", 4, 3.0, euler_options=options, mu=mu, num_train_timesteps=1000
        )


# ---------------------------------------------------------------- errors


def test_dynamic_shifting_without_mu_is_refused_like_diffusers():
    options = flow_euler.flow_euler_options(FLUX_DEV, WHERE)
    with pytest.raises(ValueError, match="mu must be passed"):
        flow_euler.flow_euler_schedule(options, 4, sigmas=flux_pipeline_sigmas(4))
    with pytest.raises(ValueError, match="`mu` must be passed"):
        FlowMatchEulerDiscreteScheduler.from_config(FLUX_DEV).set_timesteps(
            sigmas=flux_pipeline_sigmas(4)
        )


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"use_flow_sigmas": True},
            r"unknown FlowMatchEulerDiscreteScheduler keys \['use_flow_sigmas'\]",
        ),
        ({"stochastic_sampling": True}, "stochastic_sampling=True is not supported"),
        ({"time_shift_type": "cosine"}, "time_shift_type='cosine'"),
        ({"use_karras_sigmas": True, "use_beta_sigmas": True}, "use_karras_sigmas and use_beta"),
        ({"shift": "3.0"}, r"shift='3.0': expected float"),
        ({"use_dynamic_shifting": 1}, "use_dynamic_shifting=1: expected bool"),
        ({"num_train_timesteps": 1000.0}, "num_train_timesteps=1000.0: expected int"),
        ({"shift_terminal": 1.0}, r"shift_terminal=1.0: must be in \(0, 1\)"),
        ({"shift": 0.0}, "shift must be > 0"),
        ({"_class_name": "UniPCMultistepScheduler"}, "_class_name='UniPCMultistepScheduler'"),
    ],
    ids=lambda case: case if isinstance(case, str) else None,
)
def test_bad_option_is_named_with_its_file(config, message):
    with pytest.raises(flow_euler.FlowEulerConfigError, match=message) as raised:
        flow_euler.flow_euler_options({**FLUX_DEV, **config}, WHERE)
    assert str(raised.value).startswith(WHERE + ": ")


def test_every_default_valued_key_is_accepted():
    """A config that spells out every diffusers argument at its default (as newer diffusers
    versions save it) reads to the default options; ``_`` keys are bookkeeping."""
    reference = FlowMatchEulerDiscreteScheduler()
    full = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "x"}
    full.update(config_without_bookkeeping(dict(reference.config)))
    assert flow_euler.flow_euler_options(full, "full") == flow_euler.FlowEulerOptions()
    dev = flow_euler.flow_euler_options(FLUX_DEV, WHERE)
    assert dev.use_dynamic_shifting and dev.shift == 3.0 and dev.max_image_seq_len == 4096
    assert dataclasses.replace(dev, shift=1.0).shift == 1.0  # frozen, replace works


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_shift_terminal_one_step_is_refused_where_diffusers_gives_nan():
    config = {**FLUX_DEV, "shift_terminal": 0.1}
    reference = reference_scheduler(config, 1, flux_pipeline_sigmas(1), 0.8)
    assert np.isnan(reference.sigmas.numpy()[0])
    options = flow_euler.flow_euler_options(config, "ltx")
    with pytest.raises(ValueError, match="shift_terminal cannot stretch"):
        flow_euler.flow_euler_schedule(options, 1, sigmas=flux_pipeline_sigmas(1), mu=0.8)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda o: flow_euler.flow_euler_schedule(o, 5, sigmas=np.ones(4) / 2, mu=1), "4 sigmas"),
        (lambda o: flow_euler.flow_euler_schedule(o, sigmas=np.zeros((2, 2)), mu=1), "1-D"),
        (lambda o: flow_euler.flow_euler_schedule(o, mu=1.0), "num_inference_steps or sigmas"),
        (lambda o: flow_euler.flow_euler_schedule(o, 0, mu=1.0), "num_inference_steps"),
        (lambda o: flow_euler.pipeline_sigmas(0), "num_inference_steps"),
    ],
)
def test_bad_schedule_request_is_named(call, message):
    options = flow_euler.flow_euler_options(FLUX_DEV, WHERE)
    with pytest.raises(ValueError, match=message):
        call(options)
