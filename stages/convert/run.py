"""``difforge convert``: a Hugging Face dataset -> sharded TFRecords of latents + text embeddings.

Thin driver: open the source and the encoder configs, plan shards, run the Beam graph of
:mod:`stages.convert.pipeline`, check the drop rate, and commit the manifest last. A run killed
midway leaves no manifest; the rerun clears the half-written shard folders and redoes them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

from jaxcore import storage
from jaxcore.artifacts import ArtifactWriter, Manifest, write_pointer
from jaxcore.family_types import TensorSpec
from stages.common import records
from stages.common.errors import StageInputError
from stages.common.preemption import Preempted, Preemption
from stages.convert import incremental, split
from stages.convert.config import ConvertConfig
from stages.convert.encode import (
    EncoderHandler,
    EncoderLoadError,
    plan_encoders,
    plan_references,
)
from stages.convert.media import DROP_REASONS
from stages.convert.pipeline import (
    DROPPED_FILE,
    DROPPED_TAG,
    ROWS_READ,
    build_graph,
    dropped_counter,
    index_ranges,
    local_runner,
    needs_spreading,
    pipeline_options,
    plan_shards,
    read_counters,
    records_counter,
    staged_files,
    timestep_counter,
    write_empty_shards,
    write_outputs,
)
from stages.convert.source import (
    ID_ROW_INDEX,
    describe,
    keep,
    load_source,
    release,
    source_ids,
)

log = logging.getLogger(__name__)

STAGE = "convert"
WORK_FOLDERS = (*records.SPLITS, DROPPED_FILE.split("/")[0])


def run(config: ConvertConfig, *, force: bool = False) -> Manifest | None:
    """Convert ``config.dataset`` into a ``convert`` artifact at ``config.output_dir``; with
    ``base``, only the rows the base lacks (see :mod:`stages.convert.incremental`)."""
    base_manifest = incremental.resolve_base(config.base, config.latest)
    inputs = {"base": base_manifest} if base_manifest is not None else {}
    writer = ArtifactWriter(config.output_dir, STAGE, config, inputs)
    done = writer.existing(force)
    if done is not None:
        log.info("convert: %s is already finished (same config); skipping", done.uri)
        _publish(config, done)
        return done

    dataset, info, ids, id_source = _open_source(config)
    encoders = _encoder_plan(config)
    base = incremental.load_base(base_manifest) if base_manifest is not None else None
    if base is not None:
        incremental.check_compatible(base.manifest, _settings(config, encoders))
    new_indices = incremental.new_row_indices(ids, base)
    removed = incremental.removed_ids(ids, base)
    ids_by_split = _split_ids(config, [ids[index] for index in new_indices])
    if base is not None:
        log.info(
            "convert: base %s knows %d ids; %d of %d source rows are new, %d removed",
            base.uri,
            len(base.ids),
            len(new_indices),
            len(ids),
            len(removed),
        )
    plan = _shard_plan(config, encoders, ids_by_split, len(ids))
    _clear_leftovers(writer.uri)

    ranges = index_ranges(new_indices)
    first_bucket = base.eval_count() if base is not None else 0
    if config.beam.dry_run:
        _, staged = _run_beam(config, dataset, ranges, first_bucket, encoders, plan, writer.uri)
        log.info("convert: dry run built the job (staging %s); nothing was submitted", staged)
        return None
    started = time.perf_counter()
    counters: dict = {}
    if new_indices:
        counters, _ = _run_beam(config, dataset, ranges, first_bucket, encoders, plan, writer.uri)
        write_empty_shards(writer.uri, plan)
    else:
        log.info("convert: no new rows; the artifact lists the base's shards only")
    seconds = time.perf_counter() - started
    summary = _summary(config, info, encoders, plan, counters, writer.uri, seconds, id_source)
    summary["empty_prompt"] = _empty_prompt(writer.uri, base)
    entries = _write_ids(config, writer.uri, base, ids_by_split, first_bucket, removed)
    _add_base(summary, base, entries, removed, config.drop_removed)
    _check_bad_fraction(config, summary)
    manifest = writer.commit(summary)
    _publish(config, manifest)
    return manifest


def _open_source(config: ConvertConfig):
    """(dataset, its description, the rows' ids, where the ids come from) of the source,
    checked to have rows, and stable ids where an incremental convert needs them."""
    dataset = load_source(config.dataset)
    info = describe(dataset, config.dataset)
    ids, id_source = source_ids(dataset, config.dataset)
    if not ids:
        raise StageInputError(f"source {config.dataset.source}: the dataset has no rows")
    if config.base and id_source == ID_ROW_INDEX:
        raise StageInputError(
            f"base={config.base}: an incremental convert needs stable ids, but "
            "id_column=null uses row indices (which move when rows are added or removed)"
        )
    return dataset, info, ids, id_source


def _encoder_plan(config: ConvertConfig):
    """The encoders' plan for the configured media size; a model that cannot be loaded is
    the run's input error."""
    try:
        plan = plan_encoders(
            config.encoder, config.media.height, config.media.width, config.media.num_frames
        )
    except EncoderLoadError as err:
        raise StageInputError(str(err)) from None
    _check_sound(config, plan)
    size = (config.media.height, config.media.width)
    column = config.dataset.reference_image_column
    if column:  # edit pairs: the reference's latents join every record, at the record's size
        try:
            plan = plan_references(plan, *size)
        except EncoderLoadError as err:
            raise StageInputError(f"dataset.reference_image_column={column}: {err}") from None
    if not config.dataset.conditioning_image_column:
        return plan
    # the conditioning images' pixels join the encoders' tensors in every record
    pixels = TensorSpec(records.CONDITIONING_PIXELS, (*size, 3))
    return dataclasses.replace(plan, features=(*plan.features, pixels))


def _check_sound(config: ConvertConfig, plan) -> None:
    """A family whose records hold each clip's sound needs ``dataset.audio_column``; the others
    refuse it (it would be read and dropped)."""
    from jaxcore import families

    needs = families.get(plan.family).records_sound()
    column = config.dataset.audio_column
    if needs and column is None:
        raise StageInputError(
            f"the {plan.family} family's records hold each clip's sound: set "
            "dataset.audio_column (a column of sounds, or the media column for the videos' own "
            "sound tracks)"
        )
    if column is not None and not needs:
        raise StageInputError(
            f"dataset.audio_column={column}: the {plan.family} family's records hold no sound"
        )


def _split_ids(config: ConvertConfig, new_ids) -> dict[str, list]:
    """``new_ids`` by the split each is assigned to (a hash of the id: stable across runs)."""
    ids_by_split = {s: [] for s in records.SPLITS}
    for sid in new_ids:
        which = split.assign_split(sid, config.split.eval_fraction, config.split.split_seed)
        ids_by_split[which].append(sid)
    return ids_by_split


def _shard_plan(config: ConvertConfig, encoders, ids_by_split, num_rows: int):
    """The shards each split's expected records go to."""
    expected = {s: len(v) for s, v in ids_by_split.items()}
    plan = plan_shards(
        expected,
        encoders,
        config.shards.records_per_shard,
        config.shards.max_shard_bytes,
        ids_by_split,
        config.split.split_seed,
    )
    log.info(
        "convert: %d rows (expected train %d, eval %d) -> %s shards of <= %d records",
        num_rows,
        expected["train"],
        expected["eval"],
        dict(plan.num_shards),
        plan.records_per_shard,
    )
    return plan


def _clear_leftovers(uri: str) -> None:
    """Delete the work folders and files a killed run left at ``uri`` (never a finished
    artifact)."""
    for folder in WORK_FOLDERS:
        storage.delete_tree(storage.join(uri, folder))
    for name in (incremental.IDS_FILE, incremental.REMOVED_FILE, records.EMPTY_PROMPT_FILE):
        storage.delete(storage.join(uri, name))


def _empty_prompt(uri: str, base) -> dict | None:
    """The summary's ``empty_prompt`` entry: the file the job wrote, else (an incremental
    convert with no new rows) a copy of the base's; None for a base converted before it."""
    target = storage.join(uri, records.EMPTY_PROMPT_FILE)
    if storage.exists(target):
        data = storage.read_bytes(target)
    else:
        entry = base.manifest.summary.get("empty_prompt") if base is not None else None
        if not entry:
            return None
        data = storage.read_bytes(base.manifest.path(entry["file"]))
        storage.write_bytes(target, data)
    return {"file": records.EMPTY_PROMPT_FILE, "features": sorted(records.load_empty_prompt(data))}


def _settings(config: ConvertConfig, encoders) -> dict:
    """What a base must share with this run (see ``incremental.COMPATIBLE_KEYS``)."""
    return {
        "family": encoders.family,
        "features": {f.name: f.to_dict() for f in encoders.features},
        "media": _media(config),
        "latents_normalization": encoders.latent_normalization,
        "eval_fraction": config.split.eval_fraction,
        "split_seed": config.split.split_seed,
        "timesteps_list": list(config.split.timesteps_list),
    }


def _media(config: ConvertConfig) -> dict:
    return {
        "height": config.media.height,
        "width": config.media.width,
        "num_frames": config.media.num_frames,
        "fps": config.media.fps,
    }


def _write_ids(config, uri, base, ids_by_split, first_bucket, removed) -> dict:
    """``ids.jsonl`` (the base's ids plus this run's) and ``removed.jsonl``; returns the
    entries. This run's eval timesteps are recomputed with the rule the job applied."""
    dropped = incremental.dropped_ids(uri, DROPPED_FILE)
    kept_eval = sorted(set(ids_by_split[split.EVAL]) - set(dropped))
    timesteps = split.assign_timesteps(
        kept_eval, config.split.timesteps_list, config.split.split_seed, first_bucket
    )
    entries = dict(base.ids) if base is not None else {}
    entries.update(incremental.new_entries(ids_by_split, dropped, timesteps))
    incremental.write_ids(uri, entries)
    if base is not None:
        incremental.write_removed(uri, removed, entries)
    return entries


def _add_base(summary: dict, base, entries, removed, drop_removed: bool) -> None:
    """The union: base shards by URI and checksum, record totals over base and new rows."""
    summary["ids_file"] = incremental.IDS_FILE
    summary["known_ids"] = len(entries)
    if base is None:
        return
    excluded = set(removed) if drop_removed else set()
    for name in records.SPLITS:
        info = summary["splits"][name]
        info["new_records"] = info["records"]
        info["base_shards"] = list(base.shards[name])
        info["records"] = sum(
            1 for sid, e in entries.items() if e.split == name and sid not in excluded
        )
    summary["base"] = {"uri": base.uri, "manifest_sha256": base.manifest.sha256}
    summary["removed"] = {
        "count": len(removed),
        "file": incremental.REMOVED_FILE,
        "excluded": bool(drop_removed),
    }


def _publish(config: ConvertConfig, manifest: Manifest) -> None:
    """Move the ``latest`` pointer to this artifact (after its manifest: never to a partial one)."""
    if config.latest:
        write_pointer(config.latest, manifest)
        log.info("convert: %s -> %s", config.latest, manifest.uri)


def _run_beam(
    config: ConvertConfig, dataset, ranges, first_bucket: int, encoders, plan, output_dir: str
) -> tuple[dict, list[str]]:
    """Build and run the job; returns (Metrics counters, files a remote runner stages).

    ``dataset``: the driver's copy, which DoFns running in this process read (workers
    elsewhere open their own)."""
    token = keep(dataset)
    try:
        return _run_pipeline(config, token, ranges, first_bucket, encoders, plan, output_dir)
    finally:
        release(token)


def _run_pipeline(
    config: ConvertConfig, token: str, ranges, first_bucket: int, encoders, plan, output_dir: str
) -> tuple[dict, list[str]]:
    import apache_beam as beam

    handler = EncoderHandler(config.encoder, config.compute, encoders)
    options = pipeline_options(config.beam, job_name=_job_name(config.run_name))
    pipeline = beam.Pipeline(runner=local_runner(config.beam, options), options=options)
    outputs = build_graph(
        pipeline,
        ranges=ranges,
        first_eval_bucket=first_bucket,
        dataset_config=config.dataset,
        dataset_token=token,
        media_config=config.media,
        split_config=config.split,
        handler=handler,
        spread_rows=needs_spreading(config.beam),
    )
    write_outputs(outputs, output_dir, plan, config.split.split_seed)
    # SIGTERM stops the job at once: its work folders are never a finished artifact
    result = None
    with Preemption("convert", immediate=True) as preemption:
        try:
            result = pipeline.run()  # the DirectRunner runs the job here
            result.wait_until_finish()  # a remote runner's job runs here
        except BaseException:
            if not preemption.requested:
                raise
            if result is not None:  # best effort: a remote job stops too
                with contextlib.suppress(Exception):
                    result.cancel()
            # Beam may wrap the handler's exception in its own: say what happened
            raise Preempted("convert: stopped by SIGTERM; rerun to start again") from None
    return read_counters(result), staged_files(pipeline)


def _job_name(run_name: str) -> str:
    """A Dataflow-valid job name: lowercase letters, digits and hyphens."""
    cleaned = "".join(c if c.isalnum() else "-" for c in run_name.lower()).strip("-")
    return f"difforge-{cleaned or 'convert'}"[:63]


def _summary(
    config, info, encoders, plan, counters: dict, uri: str, seconds: float, id_source: str
) -> dict:
    files = storage.list_files(uri)
    shard_list = {
        s: [f.path for f in files if f.path.startswith(f"{s}/") and f.path.endswith(".tfrecord")]
        for s in records.SPLITS
    }
    counts = {s: counters.get(records_counter(s), 0) for s in records.SPLITS}
    dropped = {r: counters.get(dropped_counter(r), 0) for r in DROP_REASONS}
    rows_read = counters.get(ROWS_READ, 0)
    return {
        "source": {
            "source": info.source,
            "revision": info.revision,
            "fingerprint": info.fingerprint,
            "dataset_split": config.dataset.dataset_split,
            "num_rows": info.num_rows,
            "media_column": config.dataset.media_column,
            "caption_column": config.dataset.caption_column,
            "caption": config.dataset.caption,
            "id_column": config.dataset.id_column,
            "id_source": id_source,
            "image_columns": config.dataset.image_columns,
            "audio_column": config.dataset.audio_column,
        },
        "encoder": {
            "pretrained_model_name_or_path": config.encoder.pretrained_model_name_or_path,
            "max_sequence_length": config.encoder.max_sequence_length,
            "weights_dtype": config.compute.weights_dtype,
            "activations_dtype": config.compute.activations_dtype,
        },
        # the schema train/evaluate read (stages/common/records.py documents it)
        "family": encoders.family,
        "features": {f.name: f.to_dict() for f in encoders.features},
        "splits": {
            name: {"records": counts.get(name, 0), "shards": shard_list.get(name, [])}
            for name in records.SPLITS
        },
        "rows_read": rows_read,
        "dropped": dropped,
        "dropped_total": sum(dropped.values()),
        "dropped_file": DROPPED_FILE,
        "records_per_shard": plan.records_per_shard,
        "latents_normalization": encoders.latent_normalization,
        "media": _media(config),
        "eval_fraction": config.split.eval_fraction,
        "split_seed": config.split.split_seed,
        "timesteps_list": list(config.split.timesteps_list),
        "eval_timestep_counts": {
            str(t): counters.get(timestep_counter(t), 0) for t in config.split.timesteps_list
        },
        "runner": config.beam.runner,
        "seconds": round(seconds, 2),
        "records_per_second": round(sum(counts.values()) / seconds, 3) if seconds else None,
    }


def _check_bad_fraction(config: ConvertConfig, summary: dict) -> None:
    """Fail (no manifest) when more than ``max_bad_fraction`` of the rows were dropped."""
    rows = summary["rows_read"]
    bad = summary["dropped_total"]
    if rows and bad / rows > config.max_bad_fraction:
        reasons = ", ".join(f"{r}={n}" for r, n in summary["dropped"].items() if n)
        raise StageInputError(
            f"convert: {bad} of {rows} rows of {config.dataset.source} were dropped "
            f"({bad / rows:.1%} > max_bad_fraction={config.max_bad_fraction}): {reasons}; "
            f"see {storage.join(config.output_dir, DROPPED_FILE)}"
        )


__all__ = ["run", "DROPPED_TAG"]
