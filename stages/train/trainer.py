"""The optimiser and the one jitted training step (explicit shardings, buffer donation).

The step's randomness is ``fold_in(key(seed), step)``: with JAX's partitionable threefry the
noise and timesteps are the same on every mesh, so a sharded step equals the unsharded one
and a resumed run equals an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcore import sharding
from stages import records
from stages.train import objective
from stages.train.config import ObjectiveSection, OptimizerSection


def learning_rate_schedule(cfg: OptimizerSection, total_steps: int) -> optax.Schedule:
    """Linear warm-up over ``warmup_steps_fraction`` of the run, then constant or cosine."""
    warmup = int(cfg.warmup_steps_fraction * total_steps)
    peak = cfg.learning_rate
    if cfg.lr_schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=max(total_steps, warmup + 1),
            end_value=peak * cfg.end_learning_rate_fraction,
        )
    if warmup == 0:
        return optax.constant_schedule(peak)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
    )


def make_optimizer(cfg: OptimizerSection, total_steps: int):
    """(AdamW with optional global-norm clipping, its learning-rate schedule)."""
    schedule = learning_rate_schedule(cfg, total_steps)
    adamw = optax.adamw(
        schedule,
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.adam_weight_decay,
    )
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw), schedule
    return adamw, schedule


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def opt_state_shardings(tx, params, param_shardings, mesh: Mesh):
    """Moments follow their parameter's sharding; counters and scalars are replicated."""
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract,
        param_shardings,
        transform_non_params=lambda _: replicated(mesh),
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )


mesh_context = sharding.mesh_context


@dataclasses.dataclass
class TrainStep:
    """A compiled step: ``(params, opt_state, batch, step) -> (params, opt_state, metrics)``."""

    fn: Callable
    mesh: Mesh

    def __call__(self, params, opt_state, batch, step: int):
        with mesh_context(self.mesh):
            return self.fn(params, opt_state, batch, jnp.asarray(step, jnp.int32))


def flow_matching_loss(module, params, latents, text, key, cfg: ObjectiveSection):
    """Mean weighted flow-matching MSE of one batch (see ``objective``)."""
    key_t, key_noise = jax.random.split(key)
    batch = latents.shape[0]
    t = objective.sample_t(key_t, batch, cfg)
    timestep = t * objective.NUM_TRAIN_TIMESTEPS
    noise = jax.random.normal(key_noise, latents.shape, jnp.float32)
    x_t = objective.noisy_input(latents, noise, t)
    prediction = module.apply({"params": params}, x_t.astype(module.dtype), timestep, text)
    per_sample = objective.per_sample_loss(prediction, objective.velocity_target(latents, noise))
    return jnp.mean(per_sample * objective.loss_weight(t, cfg))


def make_train_step(
    module,
    tx,
    schedule,
    objective_cfg: ObjectiveSection,
    mesh: Mesh,
    param_shardings,
    opt_shardings,
    seed: int,
) -> TrainStep:
    """Jit the step with explicit in/out shardings; params and opt_state buffers are donated."""
    from stages.train.data import batch_sharding

    batch_shardings = {
        records.LATENTS: batch_sharding(mesh, 5),
        records.TEXT: batch_sharding(mesh, 3),
    }
    rep = replicated(mesh)

    def step_fn(params, opt_state, batch, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        latents = batch[records.LATENTS].astype(jnp.float32)
        text = batch[records.TEXT].astype(module.dtype)
        loss, grads = jax.value_and_grad(
            lambda p: flow_matching_loss(module, p, latents, text, key, objective_cfg)
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "learning_rate": schedule(step),
        }
        return params, opt_state, metrics

    jitted = jax.jit(
        step_fn,
        in_shardings=(param_shardings, opt_shardings, batch_shardings, rep),
        out_shardings=(param_shardings, opt_shardings, rep),
        donate_argnums=(0, 1),
    )
    return TrainStep(jitted, mesh)
