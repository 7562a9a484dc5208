"""The training loop: build, resume, step, log, checkpoint, eval, preempt, finish.

:func:`train` reads as the recipe: :func:`prepare` builds everything once (mesh, data, model,
optimiser, compiled step, checkpoint manager), :func:`resume` restores the latest checkpoint,
:func:`run_steps` runs the steps, and :func:`finish` saves the last checkpoint and writes the
outputs. Model-specific work is the family's (:mod:`jaxcore.families`).

Resume: the latest finished checkpoint under ``<output_dir>/checkpoints`` is restored (onto
this run's mesh) and the data pipeline starts at its step. SIGTERM (preemption) saves a
checkpoint at the current step, waits for it, and returns ``preempted`` (the stage then exits
75 without a manifest, see :mod:`stages.common.preemption`).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxcore import sharding, storage
from jaxcore.artifacts import open_artifact
from jaxcore.families import TensorSpec
from stages.common import checkpoints, data, objective, records, scoring
from stages.common.errors import StageInputError
from stages.common.preemption import Preemption
from stages.train import controlnet, metrics, model, trainer
from stages.train.config import TrainConfig, batch_mesh, global_batch_size

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LORA_DIR = "lora"


def is_writer() -> bool:
    """Process 0 writes the run's files (metrics, curves, exports, manifest); every process
    steps, evaluates and saves its part of each checkpoint."""
    return jax.process_index() == 0


@dataclasses.dataclass
class TrainResult:
    final_step: int
    final_loss: float | None
    checkpoints: list[int]
    family: str
    model_config: dict
    eval_history: list[dict]
    best_checkpoint_step: int | None
    preempted: bool
    model_source: dict
    embedded_inputs: dict  # the denoiser's scalar inputs training used (Flux dev: guidance)
    objective: dict  # the training target and its noise schedule (TrainingTarget.to_dict)
    exported_denoiser: str | None = None  # folder of the diffusers export, if any
    lora: dict | None = None  # rank, alpha, targets and the exported file of a LoRA run
    controlnet: dict | None = None  # a ControlNet run: its init, config and exported folder


@dataclasses.dataclass
class Run:
    """Everything one training run holds: built once by :func:`prepare`, mutated by the loop."""

    config: TrainConfig
    output_dir: str
    mesh: Any
    batch: int
    model: model.Model
    features: tuple[TensorSpec, ...]
    train_spec: data.DataSpec | None
    eval_spec: data.DataSpec | None
    prior_spec: data.DataSpec | None  # class examples of a prior-preservation run
    trainable: model.Trainable
    opt_state: Any
    step_fn: trainer.TrainStep
    param_shardings: Any
    mngr: Any
    log_book: metrics.MetricsLog
    local_dir: Path
    train_flops: float
    peak_flops: float
    target: objective.TrainingTarget = objective.FLOW_TARGET
    eval_fn: Any = None
    start: int = 0
    eval_history: list[dict] = dataclasses.field(default_factory=list)

    @property
    def params(self):
        """What the optimiser updates (the denoiser's params, or the LoRA adapters)."""
        return self.trainable.params

    def denoiser_params(self):
        """The denoiser's parameters now (with a LoRA: the base plus the adapters; a
        ControlNet run: the UNet's and the ControlNet's, as :meth:`step_model` takes them)."""
        if self.trainable.controlnet is not None:
            return self.trainable.effective(self.trainable.params, self.trainable.frozen)
        if not self.trainable.is_lora:
            return self.trainable.denoiser_params(self.trainable.params)
        merge = jax.jit(self.trainable.effective, out_shardings=self.param_shardings)
        with sharding.mesh_context(self.mesh):
            return merge(self.trainable.params, self.trainable.frozen)

    @property
    def lora_info(self) -> dict | None:
        """What the artifact records of a LoRA run (None for full fine-tuning)."""
        if not self.trainable.is_lora:
            return None
        lora = self.config.lora
        return {
            "rank": lora.rank,
            "alpha": lora.alpha if lora.alpha is not None else float(lora.rank),
            "scale": lora.scale,
            "targets": sorted(self.trainable.targets),
        }

    @property
    def controlnet_info(self) -> dict | None:
        """What the artifact records of a ControlNet run (None otherwise)."""
        if self.trainable.controlnet is None:
            return None
        config = self.trainable.controlnet.config.to_dict()
        return {"init": self.config.controlnet.init, "config": config}

    def step_model(self):
        """(family, module, parameter shardings) the loss and the eval score run: the UNet
        alone, or in a ControlNet run the UNet with the ControlNet (:func:`step_model`)."""
        return step_model(self.model, self.trainable, self.param_shardings)

    @property
    def embedded_inputs(self) -> dict[str, float]:
        return objective.embedded_inputs(
            self.model.family, self.model.module.config, self.config.objective
        )


# --- building ---------------------------------------------------------------------------------


def data_specs(config: TrainConfig, data_manifest):
    """(train split, eval split) of the convert artifact; None where not used."""
    train_spec = eval_spec = None
    if config.input.dataset_type == "tfrecord":
        train_spec = data.split_spec(data_manifest, "train")
    if config.evaluation.eval_every:
        eval_spec = data.split_spec(data_manifest, "eval")
        if not eval_spec.records:  # found now, not after the first eval_every steps
            raise StageInputError(
                f"{eval_spec.artifact_uri}: the eval split has no records; set "
                "evaluation.eval_every=0 or convert with a larger eval_fraction"
            )
    return train_spec, eval_spec


def prior_spec(train_spec, prior_manifest) -> data.DataSpec | None:
    """The class examples' train split, checked to hold the instance records' tensors."""
    if prior_manifest is None:
        return None
    spec = data.split_spec(prior_manifest, "train")
    if not spec.records:
        raise StageInputError(f"{spec.artifact_uri}: prior_preservation.data has no train records")
    if spec.family != train_spec.family or spec.features != train_spec.features:
        raise StageInputError(
            f"prior_preservation.data {spec.artifact_uri} holds {spec.family!r} records of "
            f"{_describe(spec.features)}, but data {train_spec.artifact_uri} holds "
            f"{train_spec.family!r} records of {_describe(train_spec.features)}: convert both "
            "with the same model and size"
        )
    return spec


def _empty_prompt(config: TrainConfig, data_manifest, features) -> dict | None:
    """The empty caption's tensors a run with ``proportion_empty_prompts`` swaps in."""
    if not config.input.proportion_empty_prompts:
        return None
    if config.input.dataset_type != "tfrecord":
        raise StageInputError(
            "proportion_empty_prompts needs tfrecord data: the empty caption's tensors come "
            "from the convert artifact"
        )
    empty = data.empty_prompt(data_manifest)
    shapes = {f.name: tuple(f.shape) for f in features}
    for name, value in empty.items():
        if shapes.get(name) != value.shape:
            raise StageInputError(
                f"{data_manifest.uri}: empty_prompt {name} has shape {list(value.shape)}, "
                f"but the records' is {list(shapes.get(name, ()))}"
            )
    return empty


def rows_per_step(batch: int, prior_spec) -> int:
    """Rows the model runs on per step: the batch, and as many class rows in a
    prior-preservation run."""
    return batch * (2 if prior_spec is not None else 1)


def _describe(features) -> str:
    return ", ".join(f"{f.name} {list(f.shape)} {f.dtype}" for f in features)


def batch_features(config: TrainConfig, built: model.Model, train_spec) -> tuple[TensorSpec, ...]:
    """The tensors of a batch: the records' (checked against the model) or synthetic ones."""
    family, denoiser_config = built.family, built.module.config
    if train_spec is None:
        latents = TensorSpec(records.LATENTS, tuple(config.input.synthetic_latent_shape))
        conditioning = family.conditioning_specs(
            denoiser_config,
            config.input.synthetic_text_length,
            latents.shape,
            config.input.synthetic_image_tokens,
        )
        features = (latents, *conditioning)
        where = "input.synthetic_latent_shape"
    else:
        features, where = train_spec.features, train_spec.artifact_uri
        if train_spec.family != family.name:
            raise StageInputError(
                f"{where} holds records of the {train_spec.family!r} family, but the model is "
                f"a {family.name!r} model"
            )
    family.check_features(denoiser_config, {f.name: f for f in features}, where)
    return features


def _forward_shapes(features):
    """(latent shape, the conditioning's shapes by name) of a batch's features."""
    shapes = {f.name: f.shape for f in features}
    return shapes.pop(records.LATENTS), shapes


def training_flops(built: model.Model, features, batch: int) -> float:
    """Model FLOPs of one training step (3x a forward, as MaxDiffusion counts)."""
    latent_shape, shapes = _forward_shapes(features)
    config = built.module.config
    return 3 * built.family.flops_per_forward(config, batch, latent_shape, shapes)


def training_attention_flops(built: model.Model, features, batch: int) -> float | None:
    """The part of :func:`training_flops` in self-attention scores and values (None: the
    family does not say), counted the same way: 3x the forward's."""
    latent_shape, shapes = _forward_shapes(features)
    config = built.module.config
    forward = built.family.attention_flops_per_forward(config, batch, latent_shape, shapes)
    return None if forward is None else 3.0 * forward


def _with_expert_range(config: TrainConfig, built: model.Model) -> TrainConfig:
    """One expert of a two-expert model trains only on the timesteps it handles."""
    wanted = built.provenance.get("timestep_range")
    if wanted is None:
        return config
    given = config.objective.timestep_range
    if given != (0.0, 1.0) and tuple(given) != tuple(wanted):
        raise StageInputError(
            f"objective.timestep_range={list(given)} conflicts with model.expert="
            f"{built.provenance['expert']}, whose range is {wanted}"
        )
    objective_cfg = dataclasses.replace(config.objective, timestep_range=tuple(wanted))
    return dataclasses.replace(config, objective=objective_cfg)


def training_target(config: TrainConfig, built: model.Model) -> objective.TrainingTarget:
    """The run's training target: epsilon / v-prediction read the noise schedule of the
    pipeline the denoiser was loaded from (None for a model YAML: the family's default); a
    denoiser from a train artifact keeps the target that run recorded."""
    origin = built.provenance
    if origin.get("source") == "train_artifact":
        manifest = open_artifact(origin["path"], "train")
        target = objective.TrainingTarget.from_dict(manifest.summary.get("objective"))
        objective.check_options(target.kind, config.objective)
        return target
    pipeline_dir = None
    if origin.get("source") == "pretrained":
        parent = Path(origin["path"]).parent
        pipeline_dir = parent if (parent / "model_index.json").is_file() else None
    return objective.training_target(built.family, config.objective, pipeline_dir)


def prepare(config: TrainConfig, output_dir: str, data_manifest, prior_manifest=None) -> Run:
    """Mesh, data, model, optimiser, compiled step and checkpoint manager of one run."""
    if config.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", config.jax_cache_dir)
    devices = jax.devices()
    mesh_config, folded = batch_mesh(config, len(devices), sharding.slice_count(devices))
    if folded:
        log.info("mesh: %s", folded)
    mesh = sharding.make_mesh(mesh_config, devices)
    batch = global_batch_size(config.per_device_batch_size, mesh.size)
    sharding.check_divisible(mesh, batch=batch)
    train_spec, eval_spec = data_specs(config, data_manifest)
    prior = prior_spec(train_spec, prior_manifest)

    built = model.build_model(config.model, config.compute, mesh, jax.random.key(config.seed))
    config = _with_expert_range(config, built)
    target = training_target(config, built)
    built.family.check_heads(built.module.config, mesh)
    features = batch_features(config, built, train_spec)
    if config.controlnet.enabled:
        controlnet.check_features(features, train_spec.artifact_uri)

    empty = _empty_prompt(config, data_manifest, features)
    param_sh = checkpoints.param_shardings(built.family, built.module, mesh)
    trainable, opt_state, step_fn = _trainable_and_step(
        config, built, mesh, features, target, prior is not None, empty
    )
    ckpt = config.checkpointing
    mngr = checkpoints.manager(
        storage.join(output_dir, CHECKPOINT_DIR),
        max_to_keep=ckpt.max_to_keep,
        async_save=ckpt.enable_async_checkpointing,
    )
    local_dir = Path(tempfile.mkdtemp(prefix="difforge-train-"))
    # Local outputs get their TensorBoard events in place; gs:// ones through an upload.
    events_dir = local_dir if storage.is_gcs(output_dir) else Path(output_dir)
    run = Run(
        config=config,
        output_dir=output_dir,
        mesh=mesh,
        batch=batch,
        model=built,
        features=features,
        train_spec=train_spec,
        eval_spec=eval_spec,
        prior_spec=prior,
        trainable=trainable,
        opt_state=opt_state,
        step_fn=step_fn,
        param_shardings=param_sh,
        mngr=mngr,
        log_book=metrics.MetricsLog(output_dir, events_dir, write=is_writer()),
        local_dir=local_dir,
        train_flops=training_flops(built, features, rows_per_step(batch, prior)),
        peak_flops=metrics.peak_flops_per_device(config.metrics.peak_flops_per_device),
        target=target,
    )
    if eval_spec is not None:
        run.eval_fn = _make_eval_fn(run)
    return run


def step_model(built: model.Model, trainable: model.Trainable, param_shardings):
    """(family, module, parameter shardings) of the loss: the denoiser's, or a ControlNet
    run's :class:`jaxcore.control.Controlled` UNet + ControlNet, whose family turns the
    records' conditioning pixels into control inputs."""
    if trainable.controlnet is None:
        return built.family, built.module, param_shardings
    from jaxcore import control

    module = control.Controlled(built.module, (trainable.controlnet,))
    shardings = {"denoiser": param_shardings, "controlnets": (trainable.shardings,)}
    return controlnet.ControlledFamily(built.family), module, shardings


def _make_trainable(config: TrainConfig, built: model.Model, mesh) -> model.Trainable:
    """Full fine-tuning, LoRA adapters, or a ControlNet beside the frozen UNet."""
    rng = jax.random.key(config.seed + 1)
    if config.controlnet.enabled:
        return model.make_controlnet_trainable(built, config.controlnet, config.compute, mesh, rng)
    return model.make_trainable(built, config.lora, mesh, rng)


def _trainable_and_step(
    config: TrainConfig,
    built: model.Model,
    mesh,
    features,
    target,
    prior_preservation: bool,
    empty_prompt,
):
    """(what the optimiser updates: the denoiser's params or LoRA adapters; their AdamW state,
    placed on the mesh; the jitted train step) of one run."""
    tx, schedule = trainer.make_optimizer(config.optimizer, config.max_train_steps)
    trainable = _make_trainable(config, built, mesh)
    family, module, _ = step_model(built, trainable, None)
    opt_sh = trainer.opt_state_shardings(tx, trainable.params, trainable.shardings, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(trainable.params)
    step_fn = trainer.make_train_step(
        family,
        module,
        tx,
        schedule,
        config.objective,
        mesh,
        trainable.shardings,
        opt_sh,
        features,
        config.seed,
        frozen_shardings=trainable.frozen_shardings,
        effective=trainable.effective,
        target=target,
        prior_loss_weight=config.prior_preservation.prior_loss_weight
        if prior_preservation
        else None,
        empty_prompt=empty_prompt,
        proportion_empty_prompts=config.input.proportion_empty_prompts,
        quantization_mode=config.compute.quantization,
    )
    return trainable, opt_state, step_fn


def _make_eval_fn(run: Run):
    """The run's jitted per-record eval loss (:func:`stages.common.scoring.make_eval_fn`),
    once the eval split's records are checked to hold the model's tensors."""
    built, spec = run.model, run.eval_spec
    built.family.check_features(built.module.config, spec.by_name, spec.artifact_uri)
    family, module, shardings = run.step_model()
    if run.trainable.controlnet is not None:
        controlnet.check_features(spec.features, spec.artifact_uri)
    return scoring.make_eval_fn(
        family,
        module,
        run.mesh,
        shardings,
        spec,
        run.config.evaluation.eval_seed,
        run.embedded_inputs,
        run.target,
    )


def resume(run: Run) -> None:
    """Restore the latest finished checkpoint of this output, if any."""
    latest = run.mngr.latest_step()
    if latest is None:
        run.log_book.resume_from(0)  # rows of a run killed before its first checkpoint go
        return
    log.info("resuming from the checkpoint at step %d", latest)
    trainable = run.trainable
    opt_shardings = jax.tree.map(lambda x: x.sharding, run.opt_state)
    params, opt_state, saved = checkpoints.restore_state(
        run.mngr, latest, *trainable.checkpoint_template(trainable.params, run.opt_state)
    )
    trainable.params, run.opt_state = trainable.from_checkpoint(params, opt_state, opt_shardings)
    run.eval_history = [e for e in saved.get("eval_history", []) if e["step"] <= latest]
    run.start = latest
    run.log_book.resume_from(latest)


# --- stepping ---------------------------------------------------------------------------------


def batches(run: Run, spec=None, seed_offset: int = 0):
    """Global batches of ``spec`` (default: the train split) from the run's start step on (same
    order as an uninterrupted run); ``seed_offset`` gives a second stream its own order. A split
    of at most ``input.in_memory_max_mib`` is held on the devices (:class:`data.DeviceBatches`),
    a larger one streams through tf.data."""
    config, local_batch = run.config, data.local_batch_size(run.batch)
    keys = tuple(f.name for f in run.features)
    spec = spec or run.train_spec
    if spec is None:
        host = data.synthetic_batches(
            run.features, local_batch, seed=config.seed, start_step=run.start
        )
    elif data.split_mib(spec) <= config.input.in_memory_max_mib:
        log.info(
            "%s (%s): %d records, %.1f MiB, held in memory (input.in_memory_max_mib=%g)",
            spec.artifact_uri,
            spec.split,
            spec.records,
            data.split_mib(spec),
            config.input.in_memory_max_mib,
        )
        arrays = data.load_split(spec)
        arrays = {name: arrays[name] for name in keys}
        seed = config.seed + seed_offset
        return data.DeviceBatches(arrays, run.mesh, run.batch, seed=seed, start_step=run.start)
    else:
        ds = data.tf_dataset(
            spec,
            local_batch,
            seed=config.seed + seed_offset,
            start_step=run.start,
            shuffle_buffer=config.input.shuffle_buffer_size,
            prefetch=config.input.prefetch_batches,
            streams=config.input.data_streams,
        )
        host = data.iterate_numpy(spec, ds)
    return (data.to_global(batch, run.mesh, run.batch, keys=keys) for batch in host)


def run_eval(run: Run, step: int) -> None:
    size = _round_up(run.config.evaluation.eval_batch_size, sharding.batch_axis_size(run.mesh))
    result = scoring.score(
        run.eval_fn,
        run.denoiser_params(),
        run.eval_spec,
        batch_size=size,
        max_records=run.config.evaluation.max_eval_records,
    )
    run.eval_history.append({"step": step, **result.to_dict()})
    log.info("step %d: eval loss %.5f", step, result.eval_loss)


def save(run: Run, step: int, force: bool = False) -> None:
    if step in run.mngr.all_steps():
        return
    opt = run.opt_state if run.config.checkpointing.save_optimizer else None
    params, opt = run.trainable.checkpoint_state(run.params, opt)
    meta = {
        "family": run.model.family.name,
        "model_config": run.model.module.config.to_dict(),
        "lora": run.lora_info,
        "controlnet": run.controlnet_info,
        "seed": run.config.seed,
        "step": step,
        "eval_history": run.eval_history,
    }
    # the metrics of the steps up to this checkpoint are made durable first: a run stopped
    # between the two resumes from the previous checkpoint and redoes (rewrites) those rows,
    # where the other order would lose them for good
    run.log_book.flush()
    checkpoints.save(run.mngr, step, params, opt, meta, force=force)


def log_step(run: Run, done: int, m: dict, seconds: float) -> None:
    flops_per_device = run.train_flops / seconds / run.mesh.size
    tokens = run.model.family.tokens_per_example(run.model.module.config, run.features[0].shape)
    run.log_book.log(
        {
            "step": done,
            "loss": float(m["loss"]),
            "learning_rate": float(m["learning_rate"]),
            "grad_norm": float(m["grad_norm"]),
            "step_time_s": seconds,
            "tokens_per_s": rows_per_step(run.batch, run.prior_spec) * tokens / seconds,
            "tflops_per_device": flops_per_device / 1e12,
            "mfu": flops_per_device / run.peak_flops,
            # prior preservation: the two parts of the loss
            **{k: float(m[k]) for k in ("instance_loss", "prior_loss") if k in m},
        }
    )


class Progress:
    """INFO lines a long run shows where no progress bar does (``kubectl logs``, a file):
    at the first and last step and at most every ``progress_every_s`` seconds, with the
    throughput measured between lines and the ETA it gives; metrics.jsonl is flushed then."""

    def __init__(self, run: Run):
        self.run = run
        self.every = run.config.metrics.progress_every_s
        self.last_time = time.monotonic()
        self.last_step = run.start

    def after_log(self, done: int) -> None:
        run, now = self.run, time.monotonic()
        last = run.config.max_train_steps
        first = self.last_step == run.start
        if not (first or done == last or now - self.last_time >= self.every):
            return
        row = run.log_book.rows[-1]
        per_step = (now - self.last_time) / max(1, done - self.last_step)
        log.info(
            "step %d/%d  loss %.5f  step %.3fs  %.0f tokens/s  ETA %s",
            done,
            last,
            row["loss"],
            per_step,
            row["tokens_per_s"],
            _duration((last - done) * per_step),
        )
        run.log_book.flush()
        self.last_time, self.last_step = now, done


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


class Profiler:
    """The optional profiler window: traces steps [start, start + num_steps)."""

    def __init__(self, run: Run):
        cfg = run.config.metrics
        self.enabled, self.first, self.count = (
            cfg.enable_profiler,
            cfg.profiler_start_step,
            cfg.profiler_num_steps,
        )
        self.run = run
        self.active = False

    def before(self, step: int) -> None:
        if self.enabled and step == self.first:
            jax.profiler.start_trace(str(_profile_dir(self.run.output_dir, self.run.local_dir)))
            self.active = True

    def after(self, done: int) -> None:
        if self.active and done >= self.first + self.count:
            self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            _upload_tree(
                self.run.local_dir / "profile", storage.join(self.run.output_dir, "profile")
            )


def run_steps(run: Run) -> tuple[bool, float | None]:
    """Steps from ``run.start`` to ``max_train_steps``; returns (preempted, last loss)."""
    from tqdm import tqdm

    config = run.config
    source = batches(run)
    prior_source = batches(run, run.prior_spec, seed_offset=1) if run.prior_spec else None
    profiler = Profiler(run)
    progress_lines = Progress(run)
    final_loss = None
    with Preemption("train") as preemption:
        progress = tqdm(
            range(run.start, config.max_train_steps),
            initial=run.start,
            total=config.max_train_steps,
            desc="train",
            disable=None,
        )
        for step in progress:
            profiler.before(step)
            global_batch = next(source)
            prior = None if prior_source is None else next(prior_source)
            t0 = time.perf_counter()
            run.trainable.params, run.opt_state, m = run.step_fn(
                run.params, run.opt_state, global_batch, step, run.trainable.frozen, prior
            )
            m = jax.device_get(m)
            seconds = time.perf_counter() - t0
            done = step + 1
            final_loss = float(m["loss"])
            if not np.isfinite(final_loss):
                raise FloatingPointError(f"loss is {final_loss} at step {done}")
            profiler.after(done)
            if done % config.metrics.log_every == 0 or done == config.max_train_steps:
                log_step(run, done, m, seconds)
                progress.set_postfix(loss=f"{final_loss:.4f}")
                progress_lines.after_log(done)
            if run.eval_fn is not None and done % config.evaluation.eval_every == 0:
                run_eval(run, done)
            if done % config.checkpointing.checkpoint_every == 0:
                save(run, done)
            if preemption.requested:
                save(run, done, force=True)
                profiler.stop()
                return True, final_loss
    profiler.stop()
    return False, final_loss


# --- finishing --------------------------------------------------------------------------------


def finish(run: Run, preempted: bool, final_loss: float | None) -> TrainResult:
    """Last eval and checkpoint, wait for saves, then the loss curve and optional export."""
    if not preempted:
        last = run.config.max_train_steps
        if run.eval_fn is not None and not any(e["step"] == last for e in run.eval_history):
            run_eval(run, last)
        save(run, last, force=True)
    run.mngr.wait_until_finished()
    steps = sorted(run.mngr.all_steps())
    run.mngr.close()
    run.log_book.close()
    if final_loss is None and run.log_book.rows:
        final_loss = run.log_book.rows[-1].get("loss")
    history = run.eval_history
    best = min(history, key=lambda e: e["eval_loss"])["step"] if history else None
    exported = exported_lora = None
    if not preempted:
        if is_writer():
            curve = storage.join(run.output_dir, "loss_curve.png")
            metrics.plot_loss_curve(run.log_book.rows, curve)
        if run.trainable.is_lora:  # the adapters, as diffusers' load_lora_weights reads them
            from jaxcore.lora.base import LORA_FILE_NAME

            exported_lora = f"{LORA_DIR}/{LORA_FILE_NAME}"
            if is_writer():  # the adapters are replicated: process 0 has them whole
                uri = storage.join(run.output_dir, LORA_DIR)
                model.export_lora(run.trainable, run.params, run.model.family, uri)
        if run.trainable.controlnet is not None:
            net_params = _host_copy(run.params)  # every process takes part
            if is_writer():
                uri = storage.join(run.output_dir, controlnet.CONTROLNET_DIR)
                controlnet.export(run.model.family, run.trainable.controlnet, net_params, uri)
        if run.config.export_diffusers:
            exported = run.model.family.denoiser_component
            params = _host_copy(run.denoiser_params())  # every process takes part
            if is_writer():
                uri = storage.join(run.output_dir, exported)
                model.export_diffusers(run.model, params, uri)
    return TrainResult(
        final_step=steps[-1] if steps else run.start,
        final_loss=final_loss,
        checkpoints=steps,
        family=run.model.family.name,
        model_config=run.model.module.config.to_dict(),
        eval_history=history,
        best_checkpoint_step=best if best in steps else None,
        preempted=preempted,
        model_source={**run.model.provenance, "seed": run.config.seed},
        embedded_inputs=run.embedded_inputs,
        objective=run.target.to_dict(),
        exported_denoiser=exported,
        lora=None if run.lora_info is None else {**run.lora_info, "file": exported_lora},
        controlnet=_controlnet_summary(run, preempted),
    )


def _controlnet_summary(run: Run, preempted: bool) -> dict | None:
    """A ControlNet run's manifest entry: its init, config and the exported folder."""
    info = run.controlnet_info
    if info is None:
        return None
    return {**info, "folder": None if preempted else controlnet.CONTROLNET_DIR}


def train(
    config: TrainConfig, output_dir: str, data_manifest=None, prior_manifest=None
) -> TrainResult:
    """Run (or resume) training into ``output_dir``; see the module docstring.
    ``prior_manifest``: the class examples of a prior-preservation (DreamBooth) run."""
    run = prepare(config, output_dir, data_manifest, prior_manifest)
    try:
        resume(run)
        preempted, final_loss = run_steps(run)
        return finish(run, preempted, final_loss)
    finally:  # its TensorBoard events and traces are in the output by now (or never will be)
        shutil.rmtree(run.local_dir, ignore_errors=True)


def _host_copy(params):
    """The whole parameter tree on this host, also when other processes hold parts of it."""
    if jax.process_count() == 1:
        return jax.device_get(params)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(params, tiled=True)


def _profile_dir(output_dir: str, local_dir: Path) -> Path:
    """Traces go straight into a local output, or to a local folder uploaded at the end."""
    return local_dir / "profile" if storage.is_gcs(output_dir) else Path(output_dir) / "profile"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _upload_tree(local: Path, uri: str) -> None:
    if not storage.is_gcs(uri):
        return
    for path in local.rglob("*"):
        if path.is_file():
            storage.upload_file(path, storage.join(uri, str(path.relative_to(local))))
