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

from jaxcore import quantization, sharding
from jaxcore.compute import train_step_compiler_options
from jaxcore.kernels.sharded import platform_of
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


# fold_in constant of the caption-dropout draw: the timestep and noise draws keep their keys
CAPTION_DROPOUT_STREAM = 0x0D20


def drop_captions(batch: dict, empty_prompt: dict, proportion: float, key: jax.Array) -> dict:
    """Each row's caption tensors (the names in ``empty_prompt``) replaced by the empty
    caption's with probability ``proportion``, drawn from ``key`` (one draw per row)."""
    rows = batch[next(iter(empty_prompt))].shape[0]
    draw = jax.random.uniform(jax.random.fold_in(key, CAPTION_DROPOUT_STREAM), (rows,))
    dropped = draw < proportion
    out = dict(batch)
    for name, row in empty_prompt.items():
        value = batch[name]
        mask = dropped.reshape((rows,) + (1,) * (value.ndim - 1))
        out[name] = jnp.where(mask, jnp.asarray(row, value.dtype)[None], value)
    return out


@dataclasses.dataclass
class TrainStep:
    """A compiled step: ``(params, opt_state, batch, step) -> (params, opt_state, metrics)``;
    ``prior``: the class examples' batch of a prior-preservation (DreamBooth) run."""

    fn: Callable
    mesh: Mesh

    def __call__(self, params, opt_state, batch, step: int, frozen=None, prior=None):
        with sharding.mesh_context(self.mesh):
            frozen = {} if frozen is None else frozen
            prior = {} if prior is None else prior
            step = jnp.asarray(step, jnp.int32)
            return self.fn(params, opt_state, frozen, batch, prior, step)


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
    prior_loss_weight: float | None = None,
    empty_prompt=None,
    proportion_empty_prompts: float = 0.0,
    quantization_mode: str = "none",
) -> TrainStep:
    """Jit the step with explicit in/out shardings; params and opt_state buffers are donated.

    ``features``: the batch's tensors (TensorSpecs); each is sharded on its batch axis.
    ``effective(params, frozen)``: the denoiser parameters the loss sees (default: ``params``;
    LoRA: the frozen base plus the adapters); only ``params`` are differentiated and updated.
    ``target``: the run's :class:`~stages.common.objective.TrainingTarget` (None: flow matching).
    ``prior_loss_weight``: a prior-preservation run (DreamBooth): each step also takes a batch
    of class examples (the same tensors), appended to the instance rows; the loss is
    :func:`~stages.common.objective.prior_preservation_loss` and the metrics carry its parts.
    ``empty_prompt`` (``{name: one row}``, the empty caption's conditioning) replaces those
    tensors in each row with probability ``proportion_empty_prompts``
    (:func:`drop_captions`). ``quantization_mode``: ``fp8`` traces the loss with the
    denoiser's dense products in float8 (:func:`jaxcore.quantization.training_products`).
    """
    effective = effective or (lambda params, frozen: params)
    embedded = objective.embedded_inputs(family, module.config, objective_cfg)

    def loss_fn(params, frozen, batch, prior, key):
        rows = 0
        if prior_loss_weight is not None:
            rows = prior[features[0].name].shape[0]
            batch = {name: jnp.concatenate([batch[name], prior[name]]) for name in batch}
        if empty_prompt and proportion_empty_prompts:
            batch = drop_captions(batch, empty_prompt, proportion_empty_prompts, key)
        with quantization.training_products(quantization_mode):
            per_sample = objective.weighted_losses(
                family,
                module,
                effective(params, frozen),
                batch,
                key,
                objective_cfg,
                embedded,
                target,
            )
        if not rows:
            return jnp.mean(per_sample), {}
        return objective.prior_preservation_loss(per_sample, rows, prior_loss_weight)

    in_shardings = _step_in_shardings(
        mesh, features, param_shardings, opt_shardings, frozen_shardings, prior_loss_weight
    )
    jitted = jax.jit(
        _optimiser_step(loss_fn, tx, schedule, seed),
        in_shardings=in_shardings,
        out_shardings=(param_shardings, opt_shardings, replicated(mesh)),
        donate_argnums=(0, 1),
        compiler_options=train_step_compiler_options(platform_of(mesh)),
    )
    return TrainStep(jitted, mesh)


def _optimiser_step(loss_fn, tx, schedule, seed: int):
    """``(params, opt_state, frozen, batch, prior, step) -> (params, opt_state, metrics)``: one
    update of ``tx`` on the gradient of ``loss_fn(params, frozen, batch, prior, key)`` (which
    returns the loss and extra metrics), its key ``fold_in(key(seed), step)``. The argument
    names are the step's interface (``pipelines.deploy`` fills them by name)."""

    def step_fn(params, opt_state, frozen, batch, prior, step):
        key = jax.random.fold_in(jax.random.key(seed), step)
        (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, frozen, batch, prior, key
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(grads),
            "learning_rate": schedule(step),
            **parts,
        }
        return params, opt_state, metrics

    return step_fn


def _step_in_shardings(
    mesh: Mesh, features, param_shardings, opt_shardings, frozen_shardings, prior_loss_weight
) -> tuple:
    """Shardings of the step's (params, opt_state, frozen, batch, prior, step): each batch
    tensor on its batch axis, a prior-preservation run's class batch as the batch (else
    empty), no frozen base unless given, the step number replicated."""
    batch_shardings = {f.name: batch_sharding(mesh, 1 + len(f.shape)) for f in features}
    frozen_shardings = {} if frozen_shardings is None else frozen_shardings
    prior_shardings = batch_shardings if prior_loss_weight is not None else {}
    return (
        param_shardings,
        opt_shardings,
        frozen_shardings,
        batch_shardings,
        prior_shardings,
        replicated(mesh),
    )
