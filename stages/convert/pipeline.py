"""The convert Beam graph: rows -> decoded clips -> the JAX encoders -> TFRecords.

    ranges --ReadRows--> rows --PrepareItem--> items --Encode--> encoded --SplitRecords-->
        train: (id, record) --> train/*.tfrecord
        eval: encoded --MakeEvalRecord (+ the eval timesteps, dealt over every eval id)-->
            eval/*.tfrecord
    (Encode: full batches of ``batch_size`` items -> the JAX encoders, loaded once per process,
    on threads of their own, two batches at once on the CPU, so the next rows decode while
    batches encode)
    PrepareItem's "dropped" side output --> dropped/dropped.jsonl (one JSON line per bad row)
    EmptyPrompt --> the encoders' tensors of the empty caption --> empty_prompt.safetensors

On the DirectRunner everything from the row ranges to the train records runs as one fused
stage; only the eval items (a tenth) wait for the eval timesteps. Every dropped row increments
a Beam ``Metrics`` counter named after its reason; the stage reads the counters after the job
and writes them into the manifest. :func:`build_graph` attaches the transforms to any pipeline
(tests pass a ``TestPipeline`` and ``assert_that``); :func:`write_outputs` the writes.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import apache_beam as beam
import numpy as np
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.transforms.window import GlobalWindows
from apache_beam.utils import shared

from jaxcore import storage
from stages.common import records
from stages.convert import media, split, tfrecord
from stages.convert.config import (
    CONTROL_ITEM,
    REFERENCE_ITEM,
    SOUND_ITEM,
    BeamConfig,
    DatasetConfig,
    MediaConfig,
    SplitConfig,
)
from stages.convert.encode import EncoderHandler, EncoderPlan

log = logging.getLogger(__name__)

NAMESPACE = "convert"
DROPPED_TAG = "dropped"
EMPTY_PROMPT_TAG = "empty_prompt"
RECORDS = "records"  # Encode's output of the encoded items
ROWS_READ = "rows_read"
ENCODE_BATCHES = "encode_batches"
ENCODE_PADDING = "encode_padding_rows"
ROWS_PER_READ = 256
ENCODE_AHEAD = 2  # batches queued for the encoder threads while the next rows are read
DROPPED_FILE = "dropped/dropped.jsonl"
RECORD_OVERHEAD_BYTES = 512  # feature names, shapes, id, TFRecord framing: a generous bound
# how a dropped row's detail names its extra image (DatasetConfig.image_columns)
IMAGE_WHAT = {CONTROL_ITEM: "conditioning image", REFERENCE_ITEM: "reference image"}


def dropped_counter(reason: str) -> str:
    return f"dropped_{reason}"


def records_counter(split_name: str) -> str:
    return f"records_{split_name}"


def timestep_counter(timestep: int) -> str:
    return f"eval_timestep_{timestep}"


@dataclass(frozen=True)
class ShardPlan:
    """Shards per split, fixed before the job so every worker writes the same names, and
    the key at which each shard starts (:func:`stages.convert.split.shard_boundaries`)."""

    records_per_shard: int
    num_shards: Mapping[str, int]
    boundaries: Mapping[str, tuple] = dataclasses.field(default_factory=dict)


def plan_shards(
    expected_counts: Mapping[str, int],
    plan: EncoderPlan,
    records_per_shard: int | None,
    max_shard_bytes: int | None,
    ids_by_split: Mapping[str, Sequence[str]] | None = None,
    seed: int = 0,
) -> ShardPlan:
    """Records per shard from the count limit and/or the byte limit, shards per split and,
    given each split's ids, where each shard starts.

    A record is ``4 *`` (its tensors' elements) bytes plus a small overhead; dropped rows only
    make shards smaller than planned, never larger.
    """
    limits = []
    if records_per_shard is not None:
        limits.append(records_per_shard)
    if max_shard_bytes is not None:
        record_bytes = 4 * sum(math.prod(shape) for shape in plan.shapes.values())
        limits.append(max(1, max_shard_bytes // (record_bytes + RECORD_OVERHEAD_BYTES)))
    per_shard = min(limits)
    shards = {s: max(1, math.ceil(expected_counts.get(s, 0) / per_shard)) for s in records.SPLITS}
    boundaries = {
        s: split.shard_boundaries(ids, per_shard, seed) for s, ids in (ids_by_split or {}).items()
    }
    return ShardPlan(per_shard, shards, boundaries)


class ReadRows(beam.DoFn):
    """``(start, stop)`` row range -> ``(source_id, media cell, caption cell)``; loads once.

    ``dataset_token``: the driver's copy of the dataset (:func:`stages.convert.source.keep`),
    used when this DoFn runs in the driver's process (the DirectRunner in memory); a worker
    process elsewhere loads its own.
    """

    def __init__(self, dataset_config: DatasetConfig, dataset_token: str | None = None):
        self._config = dataset_config
        self._token = dataset_token
        self._dataset = None
        self._rows_read = Metrics.counter(NAMESPACE, ROWS_READ)

    def setup(self):
        from stages.convert.source import dataset_root, id_kind, kept, load_source

        self._dataset = kept(self._token)
        if self._dataset is None:
            self._dataset = load_source(self._config)
        # the same rule the driver applied to the same dataset (source.source_ids)
        self._id_kind = id_kind(self._dataset, self._config)
        self._root = dataset_root(self._config)

    def process(self, row_range: tuple[int, int]) -> Iterator[tuple[str, object, object]]:
        from stages.convert.source import row_id

        start, stop = row_range
        chunk = self._dataset[start:stop]
        cfg = self._config
        for offset in range(stop - start):
            index = start + offset
            row = {name: values[offset] for name, values in chunk.items()}
            sid = row_id(self._id_kind, index, row, cfg, self._root)
            self._rows_read.inc()
            media_cell, caption = chunk[cfg.media_column][offset], chunk[cfg.caption_column][offset]
            # a ControlNet's or an edit pair's data set: the row's other images go along; a
            # video-with-sound data set: the row's sound
            images = {key: chunk[column][offset] for key, column in cfg.image_columns.items()}
            if cfg.audio_column is not None:
                images[SOUND_ITEM] = chunk[cfg.audio_column][offset]
            if images:
                yield sid, media_cell, caption, images
            else:
                yield sid, media_cell, caption


class PrepareItem(beam.DoFn):
    """A row -> ``{"source_id", "caption", "video"}`` (and per extra image of the row,
    ``"control"`` / ``"reference"`` uint8 [H, W, 3], see ``DatasetConfig.image_columns``; with
    ``DatasetConfig.audio_column``, ``"sound"``: the clip's span of its sound,
    :func:`stages.convert.media.prepare_sound`), or a ``dropped`` side output + counter."""

    def __init__(self, media_config: MediaConfig):
        self._media = media_config
        self._counters = {
            r: Metrics.counter(NAMESPACE, dropped_counter(r)) for r in media.DROP_REASONS
        }

    def process(self, row: tuple):
        source_id, cell, caption_cell = row[:3]
        cfg = self._media
        item = {"source_id": source_id}
        try:
            item["caption"] = media.clean_caption(caption_cell)
            item["video"] = media.prepare_video(
                cell, height=cfg.height, width=cfg.width, num_frames=cfg.num_frames, fps=cfg.fps
            )
            images = dict(row[3]) if len(row) > 3 else {}
            if SOUND_ITEM in images:  # a bad one drops the row as a bad video does
                seconds = cfg.num_frames / cfg.fps
                item[SOUND_ITEM] = media.prepare_sound(images.pop(SOUND_ITEM), seconds=seconds)
            for key, cell in images.items():  # a bad one drops the row as a bad image does
                item[key] = media.prepare_conditioning_image(
                    cell, height=cfg.height, width=cfg.width, what=IMAGE_WHAT[key]
                )
        except media.DropItem as drop:
            self._counters[drop.reason].inc()
            yield beam.pvalue.TaggedOutput(
                DROPPED_TAG, {"source_id": source_id, "reason": drop.reason, "detail": drop.detail}
            )
            return
        yield item


class SplitRecords(beam.DoFn):
    """An encoded item -> its train record ``(source_id, serialized tf.train.Example)`` on the
    ``train`` output, or the item itself on the ``eval`` output: an eval record carries a
    timestep, dealt over all eval ids (:class:`MakeEvalRecord`), so only eval items wait for
    the whole split; train records are made as their batch leaves the encoders."""

    def __init__(self, split_config: SplitConfig):
        self._split = split_config
        self._train_records = Metrics.counter(NAMESPACE, records_counter(split.TRAIN))

    def process(self, item: dict):
        sid = item["source_id"]
        which = split.assign_split(sid, self._split.eval_fraction, self._split.split_seed)
        if which == split.EVAL:
            yield beam.pvalue.TaggedOutput(split.EVAL, item)
            return
        self._train_records.inc()
        # records.make_example's bytes, without TensorFlow (see stages.convert.tfrecord)
        example = tfrecord.example_bytes(item["tensors"], item["caption"], sid)
        yield beam.pvalue.TaggedOutput(split.TRAIN, (sid, example))


class MakeEvalRecord(beam.DoFn):
    """An encoded eval item -> ``(source_id, serialized tf.train.Example)`` with its timestep."""

    def __init__(self, split_config: SplitConfig):
        self._eval_records = Metrics.counter(NAMESPACE, records_counter(split.EVAL))
        self._buckets = {
            t: Metrics.counter(NAMESPACE, timestep_counter(t)) for t in split_config.timesteps_list
        }

    def process(self, item: dict, eval_timesteps: Mapping[str, int]):
        sid = item["source_id"]
        timestep = eval_timesteps[sid]
        self._buckets[timestep].inc()
        self._eval_records.inc()
        yield sid, tfrecord.example_bytes(item["tensors"], item["caption"], sid, timestep)


def row_ranges(num_rows: int, rows_per_read: int = ROWS_PER_READ) -> list[tuple[int, int]]:
    return [(s, min(s + rows_per_read, num_rows)) for s in range(0, num_rows, rows_per_read)]


def index_ranges(
    indices: Sequence[int], rows_per_read: int = ROWS_PER_READ
) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges covering exactly the given row indices (an incremental
    convert's new rows), consecutive indices merged, each at most ``rows_per_read`` long."""
    ranges: list[tuple[int, int]] = []
    for index in sorted(set(indices)):
        if ranges and ranges[-1][1] == index and index - ranges[-1][0] < rows_per_read:
            ranges[-1] = (ranges[-1][0], index + 1)
        else:
            ranges.append((index, index + 1))
    return ranges


def build_graph(
    pipeline: beam.Pipeline,
    *,
    num_rows: int | None = None,
    dataset_config: DatasetConfig,
    media_config: MediaConfig,
    split_config: SplitConfig,
    handler: EncoderHandler,
    ranges: Sequence[tuple[int, int]] | None = None,
    first_eval_bucket: int = 0,
    dataset_token: str | None = None,
    spread_rows: bool = True,
) -> dict[str, beam.PCollection]:
    """Attach the convert transforms; returns ``{"train", "eval", "dropped"}`` PCollections.

    Reads rows ``0..num_rows`` or only the given ``ranges`` (an incremental convert);
    ``first_eval_bucket``: where eval timesteps start being dealt (see
    :func:`~stages.convert.split.assign_timesteps`); ``dataset_token``: see :class:`ReadRows`;
    ``spread_rows``: reshuffle the rows read (a fusion break, so that the row ranges' rows
    spread over all workers instead of staying with the worker that read them); pointless with
    one worker (see :func:`needs_spreading`), where it only pickles every row once more.
    ``train``/``eval`` hold
    ``(source_id, serialized example)``, ``dropped`` dicts ``{source_id, reason, detail}``.
    Writing them out is the caller's (see :func:`write_outputs`).
    """
    if (num_rows is None) == (ranges is None):
        raise ValueError("give num_rows or ranges")
    row_range_list = list(ranges) if ranges is not None else row_ranges(num_rows)
    rows = (
        pipeline
        # Create's own reshuffle spreads the ranges over workers: a fusion break, pointless
        # where spreading the rows is
        | "RowRanges" >> beam.Create(row_range_list, reshuffle=spread_rows)
        | "ReadRows" >> beam.ParDo(ReadRows(dataset_config, dataset_token))
    )
    if spread_rows:
        rows = rows | "SpreadRows" >> beam.Reshuffle()
    prepared = rows | "PrepareItem" >> beam.ParDo(PrepareItem(media_config)).with_outputs(
        DROPPED_TAG, main="items"
    )
    encoded = prepared.items | "Encode" >> Encode(handler, media_config)
    split_records = encoded[RECORDS] | "SplitRecords" >> beam.ParDo(
        SplitRecords(split_config)
    ).with_outputs(*records.SPLITS)
    eval_items = split_records[split.EVAL]
    eval_timesteps = (
        eval_items
        | "EvalId" >> beam.Map(lambda item: (None, item["source_id"]))
        # (not combiners.ToList: its default for an empty input costs a stage of its own;
        # without eval items nothing reads the side input)
        | "CollectEvalIds" >> beam.GroupByKey()
        | "AssignTimesteps"
        >> beam.MapTuple(
            lambda _, ids: split.assign_timesteps(
                ids, split_config.timesteps_list, split_config.split_seed, first_eval_bucket
            )
        )
    )
    eval_records = eval_items | "MakeEvalRecord" >> beam.ParDo(
        MakeEvalRecord(split_config), beam.pvalue.AsSingleton(eval_timesteps, default_value={})
    )
    return {
        split.TRAIN: split_records[split.TRAIN],
        split.EVAL: eval_records,
        DROPPED_TAG: prepared[DROPPED_TAG],
        EMPTY_PROMPT_TAG: encoded[EMPTY_PROMPT_TAG],
    }


def _empty_prompt_item(source_id: str, media_config: MediaConfig) -> dict:
    shape = (3, media_config.num_frames, media_config.height, media_config.width)
    return {"source_id": source_id, "caption": "", "video": np.zeros(shape, np.float32)}


def _is_empty_prompt(item: dict) -> bool:
    return item["source_id"] == records.EMPTY_PROMPT_ID


class Encode(beam.PTransform):
    """Items -> ``{"records": encoded items, "empty_prompt": the encoded empty caption}``.

    Items go in full batches of ``batch_size`` (a smaller batch costs as much: it is padded)
    through :class:`EncodeBatches`; the empty caption (training swaps it in for a share of the
    captions; see records.EMPTY_PROMPT_FILE) through the text encoders alone, in a branch of
    its own, with the same encoders (one load per process). With ``large_model``, Beam's
    ``RunInference`` (one model copy shared by a worker's processes) encodes both: the empty
    caption joins the items with a blank video (made on a worker: a full-size video in the job
    graph would bloat it), and only its text tensors are kept.
    """

    def __init__(self, handler: EncoderHandler, media_config: MediaConfig):
        super().__init__()
        self._handler = handler
        self._media = media_config

    def expand(self, items):
        empty = items.pipeline | "EmptyPrompt" >> beam.Create(
            [records.EMPTY_PROMPT_ID], reshuffle=False
        )
        if self._handler.share_model_across_processes():
            from apache_beam.ml.inference.base import RunInference

            from stages.convert.model_handler import EncoderModelHandler

            blank = empty | "BlankVideo" >> beam.Map(_empty_prompt_item, self._media)
            both = (items, blank) | "WithEmptyPrompt" >> beam.Flatten()
            encoded = both | "RunInference" >> RunInference(EncoderModelHandler(self._handler))
            return {
                RECORDS: encoded | "Records" >> beam.Filter(lambda i: not _is_empty_prompt(i)),
                EMPTY_PROMPT_TAG: encoded | "EmptyPromptOnly" >> beam.Filter(_is_empty_prompt),
            }
        encoders = shared.Shared()  # both DoFns acquire the same encoders
        return {
            RECORDS: items
            | "Batch" >> beam.BatchElements(**self._handler.batch_elements_kwargs())
            | "EncodeBatch" >> beam.ParDo(EncodeBatches(self._handler, encoders)),
            EMPTY_PROMPT_TAG: empty
            | "EncodeEmptyPrompt" >> beam.ParDo(EncodeEmptyPrompt(self._handler, encoders)),
        }


class EncodeBatches(beam.DoFn):
    """A batch of items -> its encoded items; the encoders load in ``setup``, once per worker
    process (shared by the process's threads, as ``RunInference`` shares its model).

    The encoders run on threads of this DoFn's own: ``process`` queues a batch and returns
    the results of the batches more than ``ENCODE_AHEAD`` behind it (in order), so this thread
    decodes and prepares the next rows (and serializes the records fused after this DoFn)
    while XLA computes, which releases the GIL; ``finish_bundle`` waits for the rest. Encoding
    one batch at a time, the two cores sat half idle at the tiny model's size; on the CPU two
    batches encode at once (``EncoderHandler.encode_threads``: the tiny convert of 1,200
    records 1.40 -> 1.21 s, the S one 4.16 -> 3.99 s).
    """

    def __init__(self, handler: EncoderHandler, encoders: shared.Shared | None = None):
        self._handler = handler
        self._shared = encoders or shared.Shared()
        self._model = None
        self._pool: ThreadPoolExecutor | None = None
        self._ahead = ENCODE_AHEAD
        self._pending: collections.deque = collections.deque()
        self._batches = Metrics.counter(NAMESPACE, ENCODE_BATCHES)
        self._padding = Metrics.counter(NAMESPACE, ENCODE_PADDING)

    def setup(self):
        self._model = self._shared.acquire(self._handler.load_model, tag="encoders")

    def start_bundle(self):
        if self._pool is None:
            threads = self._handler.encode_threads()
            self._ahead = max(ENCODE_AHEAD, threads)
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="difforge-encode")
        self._pending = collections.deque()

    def process(self, batch: Sequence[dict]) -> Iterator[dict]:
        self._batches.inc()  # (Beam's counters count on the bundle's thread only)
        self._padding.inc(self._handler.batch_size - len(batch))
        self._pending.append(self._pool.submit(self._encode, batch))
        while len(self._pending) > self._ahead:
            yield from self._pending.popleft().result()

    def finish_bundle(self):
        while self._pending:
            for item in self._pending.popleft().result():
                yield GlobalWindows.windowed_value_at_end_of_window(item)

    def teardown(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _encode(self, batch: Sequence[dict]) -> list[dict]:
        return list(self._handler.run_inference(batch, self._model))


class EncodeEmptyPrompt(beam.DoFn):
    """``EMPTY_PROMPT_ID`` -> the encoded empty caption (text tensors only)."""

    def __init__(self, handler: EncoderHandler, encoders: shared.Shared):
        self._handler = handler
        self._shared = encoders
        self._model = None

    def setup(self):
        self._model = self._shared.acquire(self._handler.load_model, tag="encoders")

    def process(self, source_id: str) -> Iterator[dict]:
        yield self._handler.encode_empty_prompt(self._model)


class WriteShard(beam.DoFn):
    """``(shard index, [(key, serialized example)])`` -> one TFRecord file, its records in key
    order, written whole (temp file, then one atomic rename / upload)."""

    def __init__(self, output_dir: str, split_name: str, num_shards: int):
        self._output_dir, self._split, self._count = output_dir, split_name, num_shards

    def process(self, element) -> Iterator[str]:
        index, keyed = element
        name = records.shard_name(self._split, index, self._count)
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, "shard.tfrecord")
            with tfrecord.TFRecordWriter(local) as writer:  # tf.io.TFRecordWriter's bytes
                for _, example in sorted(keyed, key=lambda pair: pair[0]):
                    writer.write(example)
            storage.upload_file(local, storage.join(self._output_dir, name))
        yield name


def _keyed_by_shard(pair, boundaries, seed):
    sid, example = pair
    key = split.shard_key(sid, seed)
    return split.shard_index(key, boundaries), (key, example)


def write_outputs(
    outputs: Mapping[str, beam.PCollection], output_dir: str, plan: ShardPlan, seed: int = 0
) -> None:
    """TFRecord shards named as ``records.shard_name``, each a contiguous run of the split's
    records in :func:`~stages.convert.split.shard_key` order (the same bytes on every run and
    runner); dropped rows as one JSON-lines file. Shards no record reached are written empty
    by :func:`write_empty_shards`."""
    for split_name in records.SPLITS:
        count = plan.num_shards[split_name]
        boundaries = plan.boundaries.get(split_name, ())
        if count > 1 and len(boundaries) != count:
            raise ValueError(f"the shard plan has no boundaries for the {split_name} split")
        title = split_name.title()
        _ = (
            outputs[split_name]
            | f"Key{title}" >> beam.Map(_keyed_by_shard, boundaries, seed)
            | f"Group{title}" >> beam.GroupByKey()
            | f"Write{title}" >> beam.ParDo(WriteShard(output_dir, split_name, count))
        )
    _ = outputs[EMPTY_PROMPT_TAG] | "WriteEmptyPrompt" >> beam.Map(_write_empty_prompt, output_dir)
    _ = (
        outputs[DROPPED_TAG]
        | "DroppedJson" >> beam.Map(lambda d: (None, json.dumps(d, sort_keys=True)))
        # one file, its lines sorted, written by one worker: dropped rows are few (the job
        # fails past max_bad_fraction), and WriteToText's four stages cost more than the rows
        | "GroupDropped" >> beam.GroupByKey()
        | "WriteDropped" >> beam.Map(_write_dropped, output_dir)
    )


def _write_empty_prompt(item: dict, output_dir: str) -> None:
    data = records.empty_prompt_bytes(item["tensors"])
    storage.write_bytes(storage.join(output_dir, records.EMPTY_PROMPT_FILE), data)


def _write_dropped(element, output_dir: str) -> None:
    _, lines = element
    text = "".join(f"{line}\n" for line in sorted(lines))
    storage.write_text(storage.join(output_dir, DROPPED_FILE), text)


def write_empty_shards(output_dir: str, plan: ShardPlan) -> None:
    """Every planned shard exists after the job (dropped rows may leave one empty), and the
    dropped-rows file (empty when no row was dropped)."""
    dropped = storage.join(output_dir, DROPPED_FILE)
    if not storage.exists(dropped):
        storage.write_text(dropped, "")
    for split_name in records.SPLITS:
        count = plan.num_shards[split_name]
        for index in range(count):
            uri = storage.join(output_dir, records.shard_name(split_name, index, count))
            if not storage.exists(uri):
                storage.write_bytes(uri, b"")


def needs_spreading(beam_config: BeamConfig) -> bool:
    """Whether the rows read are worth a reshuffle: not on the DirectRunner with one worker
    (everything runs in one process in order; the reshuffle cost the tiny convert of 1,200
    images ~14% of its wall)."""
    return not (beam_config.runner == "DirectRunner" and beam_config.direct_num_workers == 1)


def pipeline_options(beam_config: BeamConfig, job_name: str):
    """Beam ``PipelineOptions`` from the ``beam`` section.

    Against a local GCS server (``STORAGE_EMULATOR_HOST`` set) ``--no_auth`` makes Beam's gcsio
    use an anonymous client instead of probing for credentials (a ~19 s stall per process).
    """
    from apache_beam.options.pipeline_options import PipelineOptions

    cfg = beam_config
    args = [f"--runner={cfg.runner}", f"--job_name={cfg.job_name or job_name}"]
    if cfg.runner == "DirectRunner":
        args += [
            f"--direct_num_workers={cfg.direct_num_workers}",
            f"--direct_running_mode={cfg.direct_running_mode}",
        ]
    for key in (
        "project",
        "region",
        "temp_location",
        "staging_location",
        "sdk_container_image",
        "setup_file",
        "machine_type",
        "max_num_workers",
    ):
        value = getattr(cfg, key)
        if value is not None:
            args.append(f"--{key}={value}")
    if cfg.worker_accelerator:
        args.append(f"--dataflow_service_options=worker_accelerator={cfg.worker_accelerator}")
    if cfg.dry_run:
        args.append("--dry_run=True")
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        args.append("--no_auth")
    args += list(cfg.extra_options)
    return PipelineOptions(args, save_main_session=False)


def local_runner(beam_config: BeamConfig, options):
    """The runner object for ``runner=DirectRunner``: Beam's FnApiRunner, named here; None for
    every other runner (``options`` name it).

    Beam's DirectRunner picks its engine per job, and first tries Prism: it downloads a Go
    binary from GitHub (when the network allows), caches it and runs the job in it, where
    ``direct_running_mode`` does not apply. Without a network the attempt and the two
    graph-inspecting visitors cost every run ~0.3 s. The convert graph uses nothing the
    FnApiRunner lacks (no streaming, no real-time timers), so it runs there always: the same
    engine on every machine, and no binary fetched at run time. The provisioning info carries
    the options to the runner's workers, as Beam's DirectRunner does.
    """
    if beam_config.runner != "DirectRunner":
        return None
    from apache_beam.portability.api import beam_provision_api_pb2
    from apache_beam.runners.portability.fn_api_runner import fn_runner
    from apache_beam.runners.portability.portable_runner import JobServiceHandle

    encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
    info = beam_provision_api_pb2.ProvisionInfo(pipeline_options=encoded)
    return fn_runner.FnApiRunner(provision_info=fn_runner.ExtendedProvisionInfo(info))


def staged_files(pipeline: beam.Pipeline) -> list[str]:
    """Names of the files a remote runner stages for the job (e.g. ``workflow.tar.gz`` built
    from ``setup_file``), read from the runner's pipeline proto; empty for local runners."""
    from apache_beam.portability import common_urns
    from apache_beam.portability.api import beam_runner_api_pb2

    proto = getattr(pipeline.runner, "proto_pipeline", None)
    if proto is None:
        return []
    names = []
    for env in proto.components.environments.values():
        for dep in env.dependencies:
            if dep.role_urn == common_urns.artifact_roles.STAGING_TO.urn:
                payload = beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(
                    dep.role_payload
                )
                names.append(payload.staged_name)
    return sorted(names)


def read_counters(result) -> dict[str, int]:
    """The stage's Metrics counters, summed over steps (committed where the runner has them)."""
    totals: dict[str, int] = {}
    try:
        query = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))
    except (AttributeError, NotImplementedError):
        return totals
    for counter in query["counters"]:
        value = counter.committed if counter.committed is not None else counter.attempted
        name = counter.key.metric.name
        totals[name] = totals.get(name, 0) + int(value or 0)
    return totals
