"""The training loop: build, resume, step, log, checkpoint, eval, preempt, finish.

Resume: the latest finished checkpoint under ``<output_dir>/checkpoints`` is restored (onto
this run's mesh) and the data pipeline starts at its step. SIGTERM (preemption) saves a
checkpoint at the current step, waits for it, and returns without a manifest.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxcore import sharding, storage
from jaxcore.artifacts import open_artifact
from stages import records
from stages.train import checkpointing, data, metrics, model, trainer
from stages.train.config import TrainConfig, global_batch_size

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"


def maybe_initialize_distributed() -> bool:
    """``jax.distributed.initialize()`` on multi-host jobs (xpk/GKE JobSet, Megascale, TPU pods).

    A no-op on one machine. Must run before anything touches the devices.
    """
    markers = (
        "JOBSET_NAME",
        "MEGASCALE_COORDINATOR_ADDRESS",
        "TPU_WORKER_HOSTNAMES",
        "JAX_COORDINATOR_ADDRESS",
    )
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    multi = any(os.environ.get(m) for m in markers[:2] + markers[3:]) or "," in hosts
    if not multi or jax.distributed.is_initialized():
        return False
    jax.distributed.initialize()
    return True


class Preemption:
    """Turns SIGTERM into a flag the loop checks after each step (restored on exit)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no handler, no preemption support
            self._previous = None
        return self

    def _handle(self, signum, frame):
        log.warning("SIGTERM: saving a checkpoint and stopping")
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


@dataclasses.dataclass
class TrainResult:
    final_step: int
    final_loss: float | None
    checkpoints: list[int]
    model_config: dict
    eval_history: list[dict]
    best_checkpoint_step: int | None
    preempted: bool
    model_source: dict


def _shapes(config: TrainConfig, train_spec):
    if train_spec is not None:
        return train_spec.latent_shape, train_spec.text_shape
    return config.input.synthetic_latent_shape, config.input.synthetic_text_shape


def _batches(config, train_spec, local_batch, start_step):
    if train_spec is None:
        lat, txt = _shapes(config, None)
        return data.synthetic_batches(
            lat, txt, local_batch, seed=config.seed, start_step=start_step
        )
    ds = data.tf_dataset(
        train_spec,
        local_batch,
        seed=config.seed,
        start_step=start_step,
        shuffle_buffer=config.input.shuffle_buffer_size,
        prefetch=config.input.prefetch_batches,
    )
    return data.iterate_numpy(train_spec, ds)


def _tokens(module, latent_shape, text_shape):
    c, f, h, w = latent_shape
    pt, ph, pw = module.config.patch_size
    return (f // pt) * (h // ph) * (w // pw), text_shape[0]


def train(config: TrainConfig, output_dir: str, data_manifest=None) -> TrainResult:
    """Run (or resume) training into ``output_dir``; see the module docstring."""
    if config.jax_cache_dir:
        jax.config.update("jax_compilation_cache_dir", config.jax_cache_dir)
    mesh = sharding.make_mesh(config.mesh)
    batch = global_batch_size(config.per_device_batch_size, mesh.size)
    sharding.check_divisible(mesh, batch=batch)
    local_batch = data.local_batch_size(batch)

    train_spec = eval_spec = None
    if config.input.dataset_type == "tfrecord":
        train_spec = data.split_spec(data_manifest, "train")
    if config.evaluation.eval_every:
        eval_spec = data.split_spec(data_manifest, "eval")

    module, params, source = model.build_model(config.model, mesh, jax.random.key(config.seed))
    sharding.check_divisible(mesh, heads=module.config.num_attention_heads)
    latent_shape, text_shape = _shapes(config, train_spec)
    data.check_model_shapes(
        latent_shape,
        text_shape,
        module.config.in_channels,
        module.config.text_dim,
        config.data or "synthetic_latent_shape/synthetic_text_shape",
    )

    tx, schedule = trainer.make_optimizer(config.optimizer, config.max_train_steps)
    param_sh = model.param_target_shardings(module, mesh)
    opt_sh = trainer.opt_state_shardings(tx, params, param_sh, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    step_fn = trainer.make_train_step(
        module, tx, schedule, config.objective, mesh, param_sh, opt_sh, config.seed
    )

    ckpt_cfg = config.checkpointing
    mngr = checkpointing.manager(
        storage.join(output_dir, CHECKPOINT_DIR),
        max_to_keep=ckpt_cfg.max_to_keep,
        async_save=ckpt_cfg.enable_async_checkpointing,
    )
    meta = {"model_config": module.config.to_dict(), "seed": config.seed}
    start = 0
    local_dir = Path(tempfile.mkdtemp(prefix="difforge-train-"))
    # Local outputs get their TensorBoard events in place; gs:// ones through an upload.
    events_dir = local_dir if storage.is_gcs(output_dir) else Path(output_dir)
    log_book = metrics.MetricsLog(output_dir, events_dir)
    eval_history: list[dict] = []
    latest = mngr.latest_step()
    if latest is not None:
        log.info("resuming from the checkpoint at step %d", latest)
        params, opt_state, saved = checkpointing.restore_state(mngr, latest, params, opt_state)
        eval_history = [e for e in saved.get("eval_history", []) if e["step"] <= latest]
        start = latest
        log_book.resume_from(latest)

    video_tokens, text_tokens = _tokens(module, latent_shape, text_shape)
    from jaxcore.models.wan_transformer import flops_per_forward

    train_flops = 3 * flops_per_forward(module.config, batch, video_tokens, text_tokens)
    peak = metrics.peak_flops_per_device(config.metrics.peak_flops_per_device)
    eval_fn = None
    if eval_spec is not None:
        from stages.evaluate import scoring

        eval_fn = scoring.make_eval_fn(module, mesh, param_sh, config.evaluation.eval_seed)

    def run_eval(step):
        from stages.evaluate import scoring

        size = _round_up(config.evaluation.eval_batch_size, sharding.batch_axis_size(mesh))
        result = scoring.score(
            eval_fn,
            params,
            eval_spec,
            batch_size=size,
            max_records=config.evaluation.max_eval_records,
        )
        entry = {"step": step, **result.to_dict()}
        eval_history.append(entry)
        log.info("step %d: eval loss %.5f", step, result.eval_loss)

    def save(step, force=False):
        if step in mngr.all_steps():
            return
        opt = opt_state if ckpt_cfg.save_optimizer else None
        checkpointing.save(
            mngr,
            step,
            params,
            opt,
            {**meta, "step": step, "eval_history": eval_history},
            force=force,
        )
        log_book.flush()

    final_loss = None
    preempted = False
    profiler_on = False
    batches = _batches(config, train_spec, local_batch, start)
    from tqdm import tqdm

    with Preemption() as preemption:
        progress = tqdm(
            range(start, config.max_train_steps),
            initial=start,
            total=config.max_train_steps,
            desc="train",
            disable=None,
        )
        for step in progress:
            if config.metrics.enable_profiler and step == config.metrics.profiler_start_step:
                jax.profiler.start_trace(str(_profile_dir(output_dir, local_dir)))
                profiler_on = True
            host_batch = next(batches)
            global_batch = data.to_global(
                host_batch, mesh, batch, keys=(records.LATENTS, records.TEXT)
            )
            t0 = time.perf_counter()
            params, opt_state, m = step_fn(params, opt_state, global_batch, step)
            m = jax.device_get(m)
            seconds = time.perf_counter() - t0
            done = step + 1
            final_loss = float(m["loss"])
            if not np.isfinite(final_loss):
                raise FloatingPointError(f"loss is {final_loss} at step {done}")
            if profiler_on and done >= (
                config.metrics.profiler_start_step + config.metrics.profiler_num_steps
            ):
                jax.profiler.stop_trace()
                profiler_on = False
            if done % config.metrics.log_every == 0 or done == config.max_train_steps:
                flops_per_device = train_flops / seconds / mesh.size
                log_book.log(
                    {
                        "step": done,
                        "loss": final_loss,
                        "learning_rate": float(m["learning_rate"]),
                        "grad_norm": float(m["grad_norm"]),
                        "step_time_s": seconds,
                        "tokens_per_s": batch * video_tokens / seconds,
                        "tflops_per_device": flops_per_device / 1e12,
                        "mfu": flops_per_device / peak,
                    }
                )
                progress.set_postfix(loss=f"{final_loss:.4f}")
            if eval_fn is not None and done % config.evaluation.eval_every == 0:
                run_eval(done)
            if done % ckpt_cfg.checkpoint_every == 0:
                save(done)
            if preemption.requested:
                save(done, force=True)
                preempted = True
                break
        if profiler_on:
            jax.profiler.stop_trace()
            _upload_tree(local_dir / "profile", storage.join(output_dir, "profile"))
    if not preempted:
        last = config.max_train_steps
        if eval_fn is not None and not any(e["step"] == last for e in eval_history):
            run_eval(last)
        save(last, force=True)
    mngr.wait_until_finished()
    steps = sorted(mngr.all_steps())
    mngr.close()
    log_book.close()
    if final_loss is None and log_book.rows:
        final_loss = log_book.rows[-1].get("loss")
    best = min(eval_history, key=lambda e: e["eval_loss"])["step"] if eval_history else None
    result = TrainResult(
        final_step=steps[-1] if steps else start,
        final_loss=final_loss,
        checkpoints=steps,
        model_config=module.config.to_dict(),
        eval_history=eval_history,
        best_checkpoint_step=best if best in steps else None,
        preempted=preempted,
        model_source=source,
    )
    if not preempted:
        metrics.plot_loss_curve(log_book.rows, storage.join(output_dir, "loss_curve.png"))
        if config.export_diffusers:
            model.export_diffusers(
                module, jax.device_get(params), storage.join(output_dir, "transformer")
            )
    return result


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


def open_data(config: TrainConfig):
    """The convert artifact, when the config names one."""
    return open_artifact(config.data, "convert") if config.data else None
