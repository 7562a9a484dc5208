"""Flow Euler and UniPC samplers vs diffusers (PyTorch), step for step, in float32.

Both sides are driven by the same deterministic fake model ``v = tanh(x * A) + B * t / 1000``
(fixed random ``A``, ``B``), each integrating its *own* trajectory (no re-syncing), and every
intermediate sample is compared. Schedules (sigmas, timesteps) must match bit for bit.

Tolerance reached (fp32, CPU), free-running over 1-30 steps and shifts 1/3/5: max abs error
4.8e-7 (Euler) and 1.9e-6 (UniPC) on samples of max magnitude 3.9, i.e. <= 5e-7 relative to the
sample scale (a few float32 ulp). Asserted: |ours - ref| <= 1e-6 * max(1, max|ref|) per step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from jaxcore import schedulers
from jaxcore.schedulers import flow_euler, unipc

SHAPE = (2, 3, 4, 5)
TOL = 1e-6  # relative to the sample's scale, see assert_trajectories_close
STEP_COUNTS = (1, 2, 5, 10, 30)
SHIFTS = (1.0, 3.0, 5.0)

_rng = np.random.default_rng(1234)
A = _rng.standard_normal(SHAPE).astype(np.float32)
B = _rng.standard_normal(SHAPE).astype(np.float32)
X_INIT = _rng.standard_normal(SHAPE).astype(np.float32)

# One compile per state structure (step count, solver order); the step index is traced.
_euler_step = jax.jit(flow_euler.flow_euler_step)
_unipc_step = jax.jit(unipc.unipc_step)


def fake_velocity(x, t):
    """Deterministic stand-in for the model, written for numpy and jax arrays alike."""
    xp = jnp if isinstance(x, jax.Array) else np
    return xp.tanh(x * A) + B * (t / 1000.0)


def reference_unipc(num_steps: int, shift: float, **config) -> UniPCMultistepScheduler:
    """diffusers UniPC configured as WanPipeline uses it (Wan's scheduler_config.json)."""
    options = dict(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=shift,
        solver_order=2,
        solver_type="bh2",
        lower_order_final=True,
        predict_x0=True,
        final_sigmas_type="zero",
    )
    options.update(config)
    scheduler = UniPCMultistepScheduler(**options)
    scheduler.set_timesteps(num_steps)
    scheduler.set_begin_index(0)  # as WanPipeline does
    return scheduler


def run_reference(scheduler) -> list[np.ndarray]:
    """All intermediate samples of the diffusers loop driven by :func:`fake_velocity`."""
    x = torch.from_numpy(X_INIT.copy())
    samples = []
    for t in scheduler.timesteps:
        v = torch.from_numpy(fake_velocity(x.numpy(), float(t)))
        x = scheduler.step(v, t, x, return_dict=False)[0]
        samples.append(x.numpy().copy())
    return samples


def run_ours(state, step_fn) -> list[np.ndarray]:
    """All intermediate samples of our loop, one jitted step per model call."""
    x = jnp.asarray(X_INIT)
    samples = []
    for t in np.asarray(state.timesteps):
        x, state = step_fn(state, fake_velocity(x, float(t)), x)
        samples.append(np.asarray(x))
    return samples


def assert_trajectories_close(ours, reference):
    """Every step within ``TOL`` relative to that step's scale ``max(1, max|reference|)``."""
    assert len(ours) == len(reference)
    for step, (got, want) in enumerate(zip(ours, reference, strict=True)):
        scale = max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=0, atol=TOL * scale, err_msg=f"step {step}")


# ---------------------------------------------------------------- flow Euler


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("num_steps", STEP_COUNTS)
def test_flow_euler_schedule_matches_diffusers(num_steps, shift):
    reference = FlowMatchEulerDiscreteScheduler(shift=shift)
    reference.set_timesteps(num_steps)
    state = flow_euler.make_flow_euler(num_steps, shift=shift)
    np.testing.assert_array_equal(np.asarray(state.sigmas), reference.sigmas.numpy())
    np.testing.assert_array_equal(np.asarray(flow_euler.timesteps(state)), reference.timesteps)
    assert state.num_inference_steps == num_steps


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("num_steps", STEP_COUNTS)
def test_flow_euler_trajectory_matches_diffusers(num_steps, shift):
    reference = FlowMatchEulerDiscreteScheduler(shift=shift)
    reference.set_timesteps(num_steps)
    expected = run_reference(reference)
    state = flow_euler.make_flow_euler(num_steps, shift=shift)
    assert_trajectories_close(run_ours(state, _euler_step), expected)


def test_flow_euler_explicit_step_index_equals_state_index():
    state = flow_euler.make_flow_euler(5, shift=3.0)
    x, v = jnp.asarray(X_INIT), jnp.asarray(A)
    implicit, next_state = flow_euler.flow_euler_step(state, v, x)
    explicit, _ = flow_euler.flow_euler_step(state, v, x, step_index=0)
    np.testing.assert_array_equal(implicit, explicit)
    assert int(next_state.step_index) == 1
    later, _ = flow_euler.flow_euler_step(state, v, x, step_index=3)
    sigmas = np.asarray(state.sigmas)
    np.testing.assert_allclose(later, X_INIT + (sigmas[4] - sigmas[3]) * A, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- UniPC


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("num_steps", STEP_COUNTS)
def test_unipc_schedule_matches_diffusers(num_steps, shift):
    reference = reference_unipc(num_steps, shift)
    state = unipc.make_unipc(num_steps, shift)
    np.testing.assert_array_equal(np.asarray(state.sigmas), reference.sigmas.numpy())
    np.testing.assert_array_equal(np.asarray(unipc.timesteps(state)), reference.timesteps.numpy())


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("num_steps", STEP_COUNTS)
def test_unipc_trajectory_matches_diffusers(num_steps, shift):
    expected = run_reference(reference_unipc(num_steps, shift))
    state = unipc.make_unipc(num_steps, shift, sample_shape=SHAPE)
    assert_trajectories_close(run_ours(state, _unipc_step), expected)


@pytest.mark.parametrize(
    "config",
    [
        dict(solver_order=1),
        dict(solver_order=3),
        dict(disable_corrector=[0, 2, 3]),
    ],
    ids=["order1", "order3", "disable_corrector"],
)
def test_unipc_variants_match_diffusers(config):
    num_steps, shift = 7, 3.0
    expected = run_reference(reference_unipc(num_steps, shift, **config))
    state = unipc.make_unipc(num_steps, shift, sample_shape=SHAPE, **config)
    assert_trajectories_close(run_ours(state, _unipc_step), expected)


def test_unipc_bh1_matches_diffusers_and_stays_finite_at_sigma_zero():
    """bh1 matches diffusers on every step but the last. There diffusers computes
    ``B(h) * 0`` with ``B(h) = -h = -inf`` and returns NaN; we return the exact sigma -> 0 limit
    of the order-1 update, the data prediction ``x - sigma * v``."""
    num_steps, shift = 7, 3.0
    expected = run_reference(reference_unipc(num_steps, shift, solver_type="bh1"))
    state = unipc.make_unipc(num_steps, shift, sample_shape=SHAPE, solver_type="bh1")
    ours = run_ours(state, _unipc_step)
    assert_trajectories_close(ours[:-1], expected[:-1])
    assert np.isnan(expected[-1]).all()
    # The last update (order 1, sigma_next = 0) returns the data prediction of its input.
    x_before_last = ours[-2]
    v = fake_velocity(x_before_last, float(np.asarray(state.timesteps)[-1]))
    sigma_last = np.asarray(state.sigmas)[-2]
    np.testing.assert_allclose(ours[-1], x_before_last - sigma_last * v, rtol=TOL, atol=TOL)


def test_unipc_eager_lazy_history_matches_jitted():
    """Un-jitted stepping with history allocated by the first step equals the jitted loop."""
    num_steps, shift = 4, 5.0
    eager = run_ours(unipc.make_unipc(num_steps, shift), unipc.unipc_step)
    jitted = run_ours(unipc.make_unipc(num_steps, shift, sample_shape=SHAPE), _unipc_step)
    for got, want in zip(eager, jitted, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", schedulers.SCHEDULERS)
def test_exact_velocity_lands_on_data(name):
    """With the true velocity of a straight path (noise - x0) every solver ends at x0."""
    x0 = jnp.asarray(A)
    noise = jnp.asarray(X_INIT)
    state, step_fn = schedulers.make_scheduler(name, 6, shift=3.0, sample_shape=SHAPE)
    x = noise
    for _ in range(schedulers.num_steps(state)):
        x, state = step_fn(state, noise - x0, x)
    np.testing.assert_allclose(x, x0, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- whole loop under jit


def _fori_loop_sample(state, step_fn):
    """The full sampling loop compiled as one ``lax.fori_loop`` with a traced step index."""

    def body(i, carry):
        x, state = carry
        t = schedulers.timesteps(state)[i].astype(jnp.float32)
        return step_fn(state, fake_velocity(x, t), x)

    @jax.jit
    def sample(state, x):
        return jax.lax.fori_loop(0, schedulers.num_steps(state), body, (x, state))

    return sample(state, jnp.asarray(X_INIT))


@pytest.mark.parametrize("name", schedulers.SCHEDULERS)
def test_fori_loop_equals_step_by_step(name):
    num_steps, shift = 10, 5.0
    state, step_fn = schedulers.make_scheduler(name, num_steps, shift=shift, sample_shape=SHAPE)
    final, final_state = _fori_loop_sample(state, step_fn)
    stepwise = run_ours(state, jax.jit(step_fn))
    np.testing.assert_allclose(final, stepwise[-1], rtol=1e-6, atol=1e-6)
    assert int(final_state.step_index) == num_steps


# ---------------------------------------------------------------- registry and errors


def test_registry_builds_each_scheduler():
    state, step_fn = schedulers.make_scheduler("unipc", 8, shift=5.0)
    assert isinstance(state, unipc.UniPCState) and step_fn is unipc.unipc_step
    assert schedulers.timesteps(state).shape == (8,)
    state, _ = schedulers.make_scheduler("flow_euler", 8, shift=5.0)
    assert isinstance(state, flow_euler.FlowEulerState)
    assert schedulers.num_steps(state) == 8


def test_registry_rejects_unknown_name():
    with pytest.raises(ValueError, match="unknown scheduler 'lms'"):
        schedulers.make_scheduler("lms", 8, shift=5.0)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: unipc.make_unipc(0, 3.0), "num_inference_steps"),
        (lambda: unipc.make_unipc(5, 0.0), "flow_shift"),
        (lambda: unipc.make_unipc(5, 3.0, solver_type="bh3"), "solver_type"),
        (lambda: unipc.make_unipc(5, 3.0, lower_order_final=False), "lower_order_final"),
        (lambda: flow_euler.make_flow_euler(0), "num_inference_steps"),
        (lambda: flow_euler.make_flow_euler(5, shift=-1.0), "shift"),
    ],
)
def test_bad_configuration_is_named(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_shape_mismatch_is_named():
    x = jnp.zeros(SHAPE)
    with pytest.raises(ValueError, match="model_output shape"):
        unipc.unipc_step(unipc.make_unipc(3, 3.0), jnp.zeros((1, 2)), x)
    with pytest.raises(ValueError, match="UniPCState was built for"):
        unipc.unipc_step(unipc.make_unipc(3, 3.0, sample_shape=(1, 2)), x, x)
    with pytest.raises(ValueError, match="model_output shape"):
        flow_euler.flow_euler_step(flow_euler.make_flow_euler(3), jnp.zeros((1, 2)), x)
