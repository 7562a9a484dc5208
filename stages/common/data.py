"""Input pipelines: a convert artifact's TFRecords (tf.data) or synthetic tensors, as global
batches sharded over the mesh's batch axes.

Reproducible on resume: the record order depends only on the seed (a seeded shuffle that is
reshuffled per epoch, deterministically) and the pipeline starts at ``start_step * batch``
records, so a resumed run reads the same batches as an uninterrupted one. Skipping reads the
raw record bytes it passes over (no parsing), which is cheap next to a training step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxcore import artifacts, sharding, storage
from jaxcore.artifacts import Manifest
from jaxcore.families import TensorSpec
from stages.common import records
from stages.common.errors import StageInputError

log = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The family, per-record tensors and shard files of one split of a convert artifact."""

    artifact_uri: str
    split: str
    shards: tuple[str, ...]  # absolute URIs
    records: int
    family: str
    features: tuple[TensorSpec, ...]  # latents first, then the conditioning
    timesteps_list: tuple[int, ...] = ()
    excluded_ids: frozenset[str] = frozenset()  # records readers skip (see excluded_ids)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """{tensor name: per-record shape}."""
        return {f.name: f.shape for f in self.features}

    @property
    def by_name(self) -> dict[str, TensorSpec]:
        return {f.name: f for f in self.features}

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.features)


def _features(summary: dict, uri: str) -> tuple[TensorSpec, ...]:
    """The manifest's ``features`` table ({name: {shape, dtype}}), latents first."""
    table = summary.get("features")
    if not isinstance(table, dict) or records.LATENTS not in table:
        raise StageInputError(
            f"{uri}: the manifest summary has no 'features' table with 'latents' "
            "(written by difforge convert)"
        )
    try:
        specs = [TensorSpec.from_dict(name, value) for name, value in table.items()]
    except (KeyError, TypeError, ValueError) as err:
        raise StageInputError(f"{uri}: malformed manifest 'features' table: {err}") from None
    return tuple(sorted(specs, key=lambda f: f.name != records.LATENTS))


REMOVED_FILE = "removed.jsonl"


def empty_prompt(manifest: Manifest) -> dict[str, np.ndarray]:
    """The empty caption's conditioning tensors of a convert artifact (one row each)."""
    entry = manifest.summary.get("empty_prompt")
    if not entry:
        raise StageInputError(
            f"{manifest.uri}: the convert artifact has no empty_prompt.safetensors (converted "
            "by an older difforge); convert again to train with proportion_empty_prompts"
        )
    return records.load_empty_prompt(storage.read_bytes(manifest.path(entry["file"])))


def split_shards(manifest: Manifest, split: str) -> list[dict]:
    """Every shard one split of a convert artifact reads, ``{"uri", "size", "checksum"}``:
    those an incremental convert inherited from its base (``base_shards``, absolute URIs,
    read from a copy of the base moved together with this artifact when there is one), then
    its own (``shards``, paths in the artifact)."""
    info = (manifest.summary.get("splits") or {}).get(split) or {}
    out = [dict(entry) for entry in info.get("base_shards") or ()]
    moved = artifacts.relocate_files(manifest, [entry["uri"] for entry in out])
    for entry, uri in zip(out, moved, strict=True):
        entry["uri"] = uri
    listed = {f["path"]: f for f in manifest.files}
    for rel in info.get("shards") or ():
        entry = listed.get(rel)
        if entry is None:
            raise StageInputError(f"{manifest.uri}: shard {rel} is not in the manifest's files")
        uri = storage.join(manifest.uri, rel)
        out.append({"uri": uri, "size": entry["size"], "checksum": entry["checksum"]})
    return out


def excluded_ids(manifest: Manifest) -> frozenset[str]:
    """Source ids readers skip: those an incremental convert with ``drop_removed`` listed as
    gone from the source (their records stay in the base's shards)."""
    removed = manifest.summary.get("removed") or {}
    if not removed.get("excluded") or not removed.get("count"):
        return frozenset()
    path = storage.join(manifest.uri, removed.get("file", REMOVED_FILE))
    return frozenset(json.loads(line)["id"] for line in storage.iter_lines(path) if line.strip())


def _check_present(manifest: Manifest, shards: list[dict]) -> None:
    """Each shard exists with the size the manifest gives (one listing per folder)."""
    listings: dict[str, dict[str, int]] = {}
    for entry in shards:
        uri = entry["uri"]
        folder, _, name = uri.rpartition("/")
        if folder not in listings:
            listings[folder] = {f.path: f.size for f in storage.list_files(folder)}
        size = listings[folder].get(name)
        if size is None:
            raise StageInputError(f"{manifest.uri}: shard {uri} is listed but missing")
        if size != entry["size"]:
            raise StageInputError(
                f"{manifest.uri}: shard {uri} has {size} bytes, the manifest says {entry['size']}"
            )


def split_spec(manifest: Manifest, split: str) -> DataSpec:
    """Read a split's shard list and tensors from a convert manifest; missing files are errors."""
    summary = manifest.summary
    shards = split_shards(manifest, split)
    if not shards:
        raise StageInputError(f"{manifest.uri}: the manifest has no {split!r} split with shards")
    family = summary.get("family")
    if not isinstance(family, str):
        raise StageInputError(f"{manifest.uri}: the manifest summary names no model 'family'")
    _check_present(manifest, shards)
    info = summary["splits"][split]
    return DataSpec(
        artifact_uri=manifest.uri,
        split=split,
        shards=tuple(entry["uri"] for entry in shards),
        records=int(info.get("records", 0)),
        family=family,
        features=_features(summary, manifest.uri),
        timesteps_list=tuple(int(t) for t in summary.get("timesteps_list") or ()),
        excluded_ids=excluded_ids(manifest),
    )


def stream_shards(shards: tuple[str, ...], streams: int) -> list[list[str]]:
    """This host's data streams, each with its shard files (local paths).

    The global batch is the concatenation of ``streams`` equal parts, stream ``s`` reading
    shards ``s, s + streams, ...``; host ``p`` of ``P`` serves streams ``p * streams / P`` on.
    So the batches depend on ``streams`` only, not on how many hosts serve them: a run on
    2 hosts and one on 1 host (or resumed there) see the same data in the same order."""
    index, count = jax.process_index(), jax.process_count()
    if streams % count:
        raise StageInputError(
            f"input.data_streams={streams} does not split over {count} hosts (use a multiple)"
        )
    if len(shards) < streams:
        raise StageInputError(
            f"{len(shards)} shard files cannot feed {streams} data streams: write more shards "
            "or lower input.data_streams"
        )
    per_host = streams // count
    mine = range(index * per_host, (index + 1) * per_host)
    return [[str(storage.local_copy(s)) for s in shards[k::streams]] for k in mine]


def tf_dataset(
    spec: DataSpec,
    local_batch: int,
    *,
    seed: int,
    start_step: int,
    shuffle_buffer: int,
    prefetch: int,
    repeat: bool = True,
    with_timesteps=False,
    streams: int | None = None,
):
    """tf.data: per data stream a seeded shuffle (reshuffled per epoch), repeat, skip to
    ``start_step``, parse, batch; the host's streams concatenated row-wise (see
    :func:`stream_shards`; ``streams`` None: one per host). Without ``repeat``: one pass over
    every shard, on every host."""
    import tensorflow as tf

    def parse(x):
        return records.parse_example(x, spec.shapes, with_timesteps)

    keep = _keep_fn(spec.excluded_ids)
    if not repeat:  # every host reads every record (eval: scored as one global batch)
        ds = tf.data.TFRecordDataset([str(storage.local_copy(s)) for s in spec.shards])
        ds = ds.filter(keep) if keep else ds
        ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return ds.batch(local_batch).prefetch(prefetch)
    total = streams or jax.process_count()
    parts = stream_shards(spec.shards, total)
    if local_batch % len(parts):
        raise StageInputError(
            f"the host batch {local_batch} does not split over {len(parts)} data streams"
        )
    rows = local_batch // len(parts)
    first = jax.process_index() * len(parts)
    datasets = []
    for offset, files in enumerate(parts):
        ds = tf.data.TFRecordDataset(files)
        ds = ds.filter(keep) if keep else ds  # before the shuffle: resume skips kept records
        stream_seed = seed if total == 1 else seed + 7919 * (first + offset)
        ds = ds.shuffle(shuffle_buffer, seed=stream_seed, reshuffle_each_iteration=True)
        ds = ds.repeat().skip(start_step * rows)
        ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        datasets.append(ds.batch(rows, drop_remainder=True))
    if len(datasets) == 1:
        return datasets[0].prefetch(prefetch)

    def concat(*batches):
        return {k: tf.concat([b[k] for b in batches], axis=0) for k in batches[0]}

    return tf.data.Dataset.zip(tuple(datasets)).map(concat).prefetch(prefetch)


def _keep_fn(excluded: frozenset[str]):
    """A tf.data predicate dropping records whose ``source_id`` is excluded (None: keep all)."""
    if not excluded:
        return None
    import tensorflow as tf

    table = tf.lookup.StaticHashTable(
        tf.lookup.KeyValueTensorInitializer(
            tf.constant(sorted(excluded)), tf.ones([len(excluded)], tf.int64)
        ),
        default_value=0,
    )
    id_spec = {records.SOURCE_ID: tf.io.FixedLenFeature([], tf.string)}

    def keep(serialized):
        sid = tf.io.parse_single_example(serialized, id_spec)[records.SOURCE_ID]
        return tf.equal(table.lookup(sid), 0)

    return keep


def _explain_tf_error(spec: DataSpec, err: Exception) -> StageInputError:
    """Find the shard a tf.data error came from by reading each alone (only on the error path)."""
    import tensorflow as tf

    for shard in (str(storage.local_copy(s)) for s in spec.shards):
        try:
            ds = tf.data.TFRecordDataset([shard]).map(
                lambda x: records.parse_example(x, spec.shapes)
            )
            for _ in ds:
                pass
        except tf.errors.OpError as shard_err:
            first = str(shard_err.message).strip().splitlines()[0]
            return StageInputError(f"{spec.artifact_uri}: bad records in {shard}: {first}")
    first = str(getattr(err, "message", err)).strip().splitlines()[0]
    return StageInputError(f"{spec.artifact_uri} ({spec.split}): cannot read records: {first}")


def iterate_numpy(spec: DataSpec, dataset) -> Iterator[Batch]:
    """Yield numpy batches; a corrupt shard or a record of the wrong shape names the shard."""
    import tensorflow as tf

    iterator = iter(dataset)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except tf.errors.OpError as err:
            raise _explain_tf_error(spec, err) from None
        yield {k: v.numpy() for k, v in batch.items()}


def split_mib(spec: DataSpec) -> float:
    """MiB of the split's record tensors (what holding it in memory takes)."""
    per_record = sum(
        np.dtype(f.dtype).itemsize * int(np.prod(f.shape, dtype=np.int64)) for f in spec.features
    )
    return per_record * spec.records / 2**20


def load_split(spec: DataSpec) -> dict[str, np.ndarray]:
    """Every record of the split (less its excluded ids) in shard order: ``{tensor: [N, ...]}``."""
    dataset = tf_dataset(
        spec, 256, seed=0, start_step=0, shuffle_buffer=1, prefetch=1, repeat=False
    )
    parts: dict[str, list[np.ndarray]] = {name: [] for name in spec.tensor_names}
    for batch in iterate_numpy(spec, dataset):
        for name, chunks in parts.items():
            chunks.append(batch[name])
    if not parts[records.LATENTS]:
        raise StageInputError(f"{spec.artifact_uri}: the {spec.split!r} split has no records")
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}


class DeviceBatches:
    """Global batches gathered on the devices from a whole split held there (replicated).

    The order: epoch ``e`` visits the records in the permutation ``default_rng([seed, e])``, and
    step ``s`` takes rows ``s * B .. (s + 1) * B - 1`` of the epochs laid end to end (``B``: the
    global batch). It depends on the seed and the global batch only, not on hosts, devices or
    ``data_streams``, and a run resumed at step ``s`` reads what an uninterrupted run reads.
    Each step costs the host one index vector; the gather runs on the devices, each device
    gathering its own rows of the batch sharding.
    """

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        mesh: Mesh,
        global_batch: int,
        *,
        seed: int,
        start_step: int,
    ):
        self.count = len(arrays[records.LATENTS])
        self.global_batch, self.seed, self.step = global_batch, seed, start_step
        self._replicated = replicated(mesh)
        self._data = {name: self._put(value) for name, value in arrays.items()}
        out = {name: batch_sharding(mesh, value.ndim) for name, value in arrays.items()}
        self._gather = jax.jit(
            lambda data, rows: {name: value[rows] for name, value in data.items()},
            out_shardings=out,
        )
        self._epochs: dict[int, np.ndarray] = {}

    def _put(self, value: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(
            value.shape, self._replicated, lambda index: value[index]
        )

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            self._epochs = {e: p for e, p in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.count)
        return self._epochs[epoch]

    def rows(self, step: int) -> np.ndarray:
        """The record indices of step ``step``'s global batch."""
        flat = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, positions = np.divmod(flat, self.count)
        out = np.empty(self.global_batch, np.int32)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._permutation(int(epoch))[positions[where]]
        return out

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, jax.Array]:
        rows = self.rows(self.step)
        self.step += 1
        return self._gather(self._data, self._put(rows))


def synthetic_batches(
    features: tuple[TensorSpec, ...], local_batch: int, *, seed: int, start_step: int
) -> Iterator[Batch]:
    """Random tensors of the given shapes, indexed by step (so resume sees the same ones)."""
    step = start_step
    while True:
        rng = np.random.default_rng([seed, step, jax.process_index()])
        yield {f.name: rng.standard_normal((local_batch, *f.shape), np.float32) for f in features}
        step += 1


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, rank: int) -> NamedSharding:
    """Leading (batch) axis over the activation-batch mesh axes, the rest replicated."""
    batch_axes = sharding.logical_to_spec(("activation_batch",))[0]
    return NamedSharding(mesh, PartitionSpec(batch_axes, *([None] * (rank - 1))))


def local_batch_size(global_batch: int) -> int:
    count = jax.process_count()
    if global_batch % count:
        raise StageInputError(
            f"the global batch {global_batch} does not split over {count} hosts "
            "(per_device_batch_size x devices must be a multiple of the host count)"
        )
    return global_batch // count


def to_global(batch: Batch, mesh: Mesh, global_batch: int, keys):
    """Assemble each host's slice into one global jax.Array per key, sharded on the mesh."""
    out = {}
    for key in keys:
        local = batch[key]
        shape = (global_batch, *local.shape[1:])
        out[key] = jax.make_array_from_process_local_data(
            batch_sharding(mesh, local.ndim), local, shape
        )
    return out
