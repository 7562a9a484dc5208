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
from jax.sharding import Mesh, NamedSharding

from jaxcore import sharding
from stages.common import objective
from stages.common.data import batch_sharding, replicated
from stages.common.objective import ObjectiveSection
from stages.train.config import OptimizerSection


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


@dataclasses.dataclass
class TrainStep:
    """A compiled step: ``(params, opt_state, batch, step) -> (params, opt_state, metrics)``."""

    fn: Callable
    mesh: Mesh

    def __call__(self, params, opt_state, batch, step: int, frozen=None):
        with sharding.mesh_context(self.mesh):
            frozen = {} if frozen is None else frozen
            return self.fn(params, opt_state, frozen, batch, jnp.asarray(step, jnp.int32))


def make_train_step(
    family,
    module,
    tx,
    schedule,
    objective_cfg: ObjectiveSection,
    mesh: Mesh,
    param_shardings,
    opt_shardings,
    features,
    seed: int,
    *,
    frozen_shardings=None,
    effective=None,
    target=None,
) -> TrainStep:
    """Jit the step with explicit in/out shardings; params and opt_state buffers are donated.

    ``features``: the batch's tensors (TensorSpecs); each is sharded on its batch axis.
    ``effective(params, frozen)``: the denoiser parameters the loss sees (default: ``params``;
    LoRA: the frozen base plus the adapters); only ``params`` are differentiated and updated.
    ``target``: the run's :class:`~stages.common.objective.TrainingTarget` (None: flow matching).
    """
    effective = effective or (lambda params, frozen: params)
    batch_shardings = {f.name: batch_sharding(mesh, 1 + len(f.shape)) for f in features}
    rep = replicated(mesh)
    embedded = objective.embedded_inputs(family, module.config, objective_cfg)

    def step_fn(params, opt_state, frozen, batch, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        loss, grads = jax.value_and_grad(
            lambda p: objective.training_loss(
                family, module, effective(p, frozen), batch, key, objective_cfg, embedded, target
            )
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "learning_rate": schedule(step),
        }
        return params, opt_state, metrics

    frozen_shardings = {} if frozen_shardings is None else frozen_shardings
    jitted = jax.jit(
        step_fn,
        in_shardings=(param_shardings, opt_shardings, frozen_shardings, batch_shardings, rep),
        out_shardings=(param_shardings, opt_shardings, rep),
        donate_argnums=(0, 1),
    )
    return TrainStep(jitted, mesh)
