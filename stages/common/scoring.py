"""Eval-timestep scoring, shared by ``evaluate`` and periodic eval in ``train`` (any family).

Each eval record is scored at the fixed timestep it carries, with noise drawn from a key
derived from its ``source_id`` (not its position), so a score does not depend on shard order,
batch size or mesh. The per-sample loss is the training objective's unweighted MSE
(:func:`stages.common.objective.eval_loss_at`: flow matching at ``t = timestep / 1000``;
epsilon / v-prediction at the integer DDPM timestep ``clip(round(timestep), 0, T - 1)``, so
1000 is scored at 999, without the training-only noise offset, input perturbation or min-SNR
weights); losses are averaged per
timestep bucket, and the eval loss is the mean of the bucket means (SD3 arXiv 2403.03206,
MaxDiffusion ``BaseWanTrainer.eval``, MLPerf text-to-image validation).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator

import jax
import numpy as np

from jaxcore import quantization, sharding
from stages.common import objective, records
from stages.common.data import DataSpec, batch_sharding, iterate_numpy, replicated, tf_dataset

TIMESTEPS = records.TIMESTEPS
IDS = "source_id_hash"


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Bucket means by timestep, record counts, and the overall (mean of bucket means)."""

    bucket_means: dict[int, float]
    bucket_counts: dict[int, int]
    eval_loss: float

    def to_dict(self) -> dict:
        return {
            "eval_loss": self.eval_loss,
            "bucket_means": {str(k): v for k, v in sorted(self.bucket_means.items())},
            "bucket_counts": {str(k): v for k, v in sorted(self.bucket_counts.items())},
        }


def source_id_hash(source_id: bytes | str) -> np.uint32:
    """A stable 32-bit number of a record's id (the noise key is folded with it)."""
    raw = source_id.encode() if isinstance(source_id, str) else bytes(source_id)
    return np.uint32(int.from_bytes(hashlib.sha256(raw).digest()[:4], "little"))


def record_noise(seed: int, id_hashes: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Per-record noise from ``fold_in(key(seed), hash(source_id))``."""
    base = jax.random.key(seed)
    return jax.vmap(lambda h: jax.random.normal(jax.random.fold_in(base, h), shape))(id_hashes)


def per_record_loss(
    family, module, params, tensors, timesteps, id_hashes, seed: int, embedded=None, target=None
):
    """Loss of each record at its own timestep (0..1000) and its own noise; ``target``: the
    run's :class:`~stages.common.objective.TrainingTarget` (None: flow matching)."""
    latents, conditioning = objective.split_batch(tensors, embedded)
    noise = record_noise(seed, id_hashes, latents.shape[1:])
    return objective.eval_loss_at(
        family, module, params, latents, conditioning, timesteps, noise, target
    )


def eval_batches(spec: DataSpec, batch_size: int, max_records: int | None) -> Iterator[dict]:
    """Every eval record once, in file order, batches padded to ``batch_size`` (``valid`` mask).

    Every host reads the whole eval split (it is small) and scores it as one global batch.
    """
    ds = tf_dataset(
        spec,
        batch_size,
        seed=0,
        start_step=0,
        shuffle_buffer=1,
        prefetch=1,
        repeat=False,
        with_timesteps=True,
    )
    seen = 0
    for batch in iterate_numpy(spec, ds):
        n = len(batch[records.SOURCE_ID])
        if max_records is not None:
            n = min(n, max_records - seen)
            if n <= 0:
                return
        seen += n
        pad = batch_size - n
        out = {name: batch[name][:n] for name in spec.tensor_names}
        out[TIMESTEPS] = batch[records.TIMESTEPS][:n].astype(np.int32)
        out[IDS] = np.array([source_id_hash(s) for s in batch[records.SOURCE_ID][:n]], np.uint32)
        out = {k: np.concatenate([v, np.repeat(v[-1:], pad, axis=0)]) for k, v in out.items()}
        out["valid"] = np.arange(batch_size) < n
        yield out


def _global(x: np.ndarray, mesh) -> jax.Array:
    """A host-complete numpy batch as a global array sharded on the batch axes."""
    sh = batch_sharding(mesh, x.ndim)
    return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])


def make_eval_fn(
    family,
    module,
    mesh,
    param_shardings,
    spec: DataSpec,
    seed: int,
    embedded=None,
    target=None,
    quantization_mode: str = "none",
):
    """Jitted ``(params, batch from eval_batches) -> per-record loss`` for ``spec``'s tensors;
    ``embedded``: the denoiser's scalar inputs, and ``target``: the training target (noise
    schedule), as training used them. ``quantization_mode``: the params come quantized
    (:mod:`jaxcore.quantization`; they keep the shardings they were quantized on)."""
    tensor_shardings = {f.name: batch_sharding(mesh, 1 + len(f.shape)) for f in spec.features}
    embedded = dict(embedded or {})
    products = quantization.quantizes_products(quantization_mode)

    def loss(p, tensors, ts, ids):
        p = quantization.for_denoiser(p, products, module.param_dtype)
        return per_record_loss(family, module, p, tensors, ts, ids, seed, embedded, target)

    fn = jax.jit(
        loss,
        in_shardings=(
            None if quantization_mode != "none" else param_shardings,
            tensor_shardings,
            batch_sharding(mesh, 1),
            batch_sharding(mesh, 1),
        ),
        out_shardings=replicated(mesh),
    )

    def call(params, batch):
        with sharding.mesh_context(mesh):
            tensors = {name: _global(batch[name], mesh) for name in spec.tensor_names}
            out = fn(params, tensors, _global(batch[TIMESTEPS], mesh), _global(batch[IDS], mesh))
            return np.asarray(jax.device_get(out))

    return call


def score(
    eval_fn, params, spec: DataSpec, *, batch_size: int, max_records: int | None = None
) -> EvalResult:
    """Bucket means per timestep and their mean, accumulated in float64 on the host."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for batch in eval_batches(spec, batch_size, max_records):
        losses = eval_fn(params, batch)
        for loss, t, ok in zip(losses, batch[TIMESTEPS], batch["valid"], strict=True):
            if ok:
                sums[int(t)] = sums.get(int(t), 0.0) + float(loss)
                counts[int(t)] = counts.get(int(t), 0) + 1
    if not counts:
        raise ValueError(f"{spec.artifact_uri}: the {spec.split} split has no records to score")
    means = {t: sums[t] / counts[t] for t in sorted(counts)}
    return EvalResult(means, counts, float(np.mean(list(means.values()))))
