"""Bulk rendering: group prompts by shape, batch, shard, render, hand results to writers.

- Prompts are grouped by :attr:`PromptSpec.group_key` (size, frames, steps, CFG on/off, shift,
  LoRA set; the LoRAs are merged from the base weights when the set changes)
  in file order, so each group compiles once; a group is cut into global batches of
  ``batch_size`` prompts, each padded (by repeating its last prompt) to a multiple of the
  mesh's batch ways.
- Each process renders the rows of every batch that land on its own devices (a disjoint share
  of the list, ``jax.process_index``), and writes only those.
- Initial noise comes from each prompt's own seed (or its ``latents`` / ``audio_latents``
  .npy files; the family joins them, :meth:`Family.initial_latents`), so a prompt's output
  never depends on the batch it was in, the batch size or the device count.
- The device work of batch k+1 is dispatched before the host waits for batch k, and encoding /
  uploading runs in a writer thread pool, so host and device work overlap.
- The prompts of the next batches are text-encoded together, up to
  :data:`jaxcore.pipeline.ENCODE_BATCH` texts per encoder call (:func:`encode_groups`): a text
  encoder at small batch is bound by reading its weights, so one call for many prompts costs
  about what one prompt did. A repeated negative prompt is encoded once per group. The groups
  follow from the whole plan, so a resumed run (which skips finished batches and re-renders a
  partly finished one whole) gives every prompt the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from jaxcore import storage
from stages.common.errors import StageInputError
from stages.generate.images import read_image
from stages.generate.prompts import PromptSpec

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Batch:
    """One global batch of same-shape prompts, and this process's rows of it."""

    specs: tuple[PromptSpec, ...]  # the real prompts of the whole (global) batch
    padded_size: int  # global rows after padding (a multiple of the batch ways)
    local_rows: tuple[int, ...]  # global row indices this process renders

    def row_spec(self, row: int) -> PromptSpec:
        """The prompt rendered in ``row`` (padding rows repeat the last prompt)."""
        return self.specs[min(row, len(self.specs) - 1)]

    def local_real(self) -> list[tuple[int, PromptSpec]]:
        """(row, spec) of this process's rows that hold a real prompt (not padding)."""
        return [(r, self.specs[r]) for r in self.local_rows if r < len(self.specs)]


def global_batch_size(per_device_batch_size: float, batch_ways: int) -> int:
    """Prompts per batch: ``per_device_batch_size`` x the mesh's batch ways, at least 1."""
    return max(1, int(round(per_device_batch_size * batch_ways)))


def plan_batches(
    specs: Sequence[PromptSpec],
    batch_size: int,
    batch_ways: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[Batch]:
    """Group by shape (first appearance order), cut into batches, pad, split over processes."""
    groups: dict[tuple, list[PromptSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.group_key, []).append(spec)
    padded = math.ceil(batch_size / batch_ways) * batch_ways
    if padded % process_count:
        raise StageInputError(
            f"a batch of {padded} rows does not split over {process_count} processes; "
            "raise per_device_batch_size"
        )
    per_process = padded // process_count
    rows = tuple(range(process_index * per_process, (process_index + 1) * per_process))
    batches = []
    for members in groups.values():
        for start in range(0, len(members), batch_size):
            chunk = tuple(members[start : start + batch_size])
            batches.append(Batch(chunk, padded, rows))
    return batches


def read_latents(spec: PromptSpec, shape: Sequence[int], field: str = "latents") -> np.ndarray:
    """The prompt's ``field`` .npy (``latents``, ``audio_latents``), checked against the
    expected per-sample shape."""
    where = f"line {spec.line} (id {spec.id!r})"
    uri = spec.latent_files[field]
    try:
        array = np.load(io.BytesIO(storage.read_bytes(uri)), allow_pickle=False)
    except storage.StorageError:
        raise StageInputError(f"{where}: {field} file {uri} does not exist") from None
    except ValueError as err:
        raise StageInputError(f"{where}: {field} file {uri} is not a .npy: {err}") from None
    if array.ndim == len(shape) + 1 and array.shape[0] == 1:
        array = array[0]  # a [1, C, F, H, W] dump of a single-prompt run
    if tuple(array.shape) != tuple(shape):
        raise StageInputError(
            f"{where}: {field} {uri} has shape {tuple(array.shape)}, but "
            f"{spec.height}x{spec.width} with {spec.num_frames} frame(s) needs {tuple(shape)}"
        )
    return array.astype(np.float32)


def read_latent_files(spec: PromptSpec, inputs: dict[str, tuple[int, ...]]) -> dict:
    """The prompt's initial-latent arrays by field, each checked against ``inputs`` (the
    model's :meth:`Family.latent_inputs`); a file the model takes no array for is an error
    naming the line and the field."""
    given = {}
    for field in spec.latent_files:
        if field not in inputs:
            raise StageInputError(
                f"line {spec.line} (id {spec.id!r}): {field} is not an initial array of this "
                f"model's renders (its family takes {sorted(inputs)}); leave it out"
            )
        given[field] = read_latents(spec, inputs[field], field)
    return given


def check_latent_files(specs: Sequence[PromptSpec], latent_inputs: Callable) -> None:
    """Before rendering: every initial-latent file is one the model takes, exists and has the
    right shape (``latent_inputs(height, width, num_frames, settings)``: field -> shape)."""
    for spec in specs:
        if spec.latent_files:
            settings = dict(spec.micro_conditioning)
            size = (spec.height, spec.width, spec.num_frames)
            read_latent_files(spec, latent_inputs(*size, settings))


def available_host_bytes() -> int | None:
    """What this host can still allocate (``MemAvailable``), None where that is unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def device_bytes_limit() -> int | None:
    """One local accelerator's memory (``bytes_limit``); None on a CPU (its memory is the
    host's)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


def render_bytes_floor(spec: PromptSpec, latent_shape: Callable) -> tuple[int, int]:
    """(device, host) bytes one render of ``spec`` cannot do without: the latents with the
    noise and the prediction beside them, and the decoded frames (float32 on the device; on
    the host, with their 8-bit copy). A lower bound: weights and activations come on top."""
    size = (spec.height, spec.width, spec.num_frames)
    latents = 4 * math.prod(latent_shape(*size, dict(spec.micro_conditioning)))
    pixels = spec.height * spec.width * spec.num_frames * 3
    return 3 * latents + 4 * pixels, 4 * pixels + pixels


def check_memory(
    specs: Sequence[PromptSpec],
    latent_shape: Callable,
    prompt_file: str,
    host_bytes: int | None = None,
    device_bytes: int | None = None,
) -> None:
    """Before loading the model: refuse a line whose render cannot fit this machine even
    without weights or activations, naming the line and the memory it would need."""
    host_bytes = available_host_bytes() if host_bytes is None else host_bytes
    device_bytes = device_bytes_limit() if device_bytes is None else device_bytes
    gib = 1 << 30
    for spec in specs:
        on_device, on_host = render_bytes_floor(spec, latent_shape)
        where = f"{prompt_file} line {spec.line} (id {spec.id!r})"
        size = f"{spec.height}x{spec.width}, {spec.num_frames} frame(s)"
        if device_bytes and on_device > device_bytes:
            raise StageInputError(
                f"{where}: a {size} render needs at least {on_device / gib:,.1f} GiB on one "
                f"device (latents and decoded frames alone), which has {device_bytes / gib:,.1f} "
                "GiB; lower height, width or num_frames"
            )
        if host_bytes and on_host > host_bytes:
            raise StageInputError(
                f"{where}: a {size} render needs at least {on_host / gib:,.1f} GiB of host "
                f"memory (its decoded frames alone), and {host_bytes / gib:,.1f} GiB is "
                "available; lower height, width or num_frames"
            )


def check_image_files(specs: Sequence[PromptSpec]) -> dict[str, str]:
    """Before rendering: every ``image`` (each of a line's list) / ``last_image`` reads as an
    image, every frame condition's image or video as one. Returns ``{uri: sha256}`` (a changed file re-renders
    its prompts on resume)."""
    checksums = {}
    for spec in specs:
        where = f"line {spec.line} (id {spec.id!r})"
        for uri in (*spec.image_uris, spec.last_image):
            if uri is not None and uri not in checksums:
                _, data = read_image(uri, where)
                checksums[uri] = hashlib.sha256(data).hexdigest()
        for kind, uri, _, _ in spec.conditions:
            if uri not in checksums:
                _, data = (read_image if kind == "image" else read_video)(uri, where)
                checksums[uri] = hashlib.sha256(data).hexdigest()
    return checksums


def read_video(uri: str, where: str):
    """A conditioning video (local or gs://) as (its frames as PIL images; its bytes): a
    ``.npy`` of frames ``[F, H, W, 3]`` in [0, 1] (rounded to 8 bits, as an image file holds
    them), or a video file imageio reads."""
    from PIL import Image

    try:
        data = storage.read_bytes(uri)
    except storage.StorageError:
        raise StageInputError(f"{where}: video {uri} does not exist") from None
    try:
        if uri.endswith(".npy"):
            frames = np.load(io.BytesIO(data), allow_pickle=False)
            if frames.ndim != 4 or frames.shape[-1] != 3 or not np.isfinite(frames).all():
                raise ValueError(f"expected finite frames [F, H, W, 3], got {frames.shape}")
            frames = np.round(np.clip(frames, 0.0, 1.0) * 255.0).astype(np.uint8)
        else:
            import imageio.v3 as iio

            frames = np.asarray(
                iio.imread(data, index=None, extension="." + uri.rsplit(".", 1)[-1])
            )
            if frames.ndim != 4:
                raise ValueError(f"expected frames [F, H, W, C], got {frames.shape}")
            frames = frames[..., :3].astype(np.uint8)
    except (ValueError, OSError) as err:
        raise StageInputError(f"{where}: {uri} is not a readable video: {err}") from None
    return [Image.fromarray(frame) for frame in frames], data


def _conditions(spec: PromptSpec) -> list[dict]:
    """The prompt's frame conditions as the family takes them (images and frames decoded)."""
    where = f"line {spec.line} (id {spec.id!r})"
    out = []
    for kind, uri, frame_index, strength in spec.conditions:
        media = (read_image if kind == "image" else read_video)(uri, where)[0]
        out.append({kind: media, "frame_index": frame_index, "strength": strength})
    return out


def with_image_sizes(specs: Sequence[PromptSpec], max_images: int) -> list[PromptSpec]:
    """For a model that takes several reference images (``max_images`` > 1): each prompt with
    its references' (width, height), so a batch shares their token layout
    (:attr:`PromptSpec.group_key`); otherwise the prompts as they are."""
    if max_images < 2:
        return list(specs)
    out = []
    for spec in specs:
        if spec.image is not None:
            where = f"line {spec.line} (id {spec.id!r})"
            sizes = tuple(tuple(read_image(u, where)[0].size) for u in spec.image_uris)
            spec = dataclasses.replace(spec, image_sizes=sizes)
        out.append(spec)
    return out


def _images(spec: PromptSpec) -> tuple:
    """The prompt's ``(image, last_image)`` as the family takes them: PIL images (a list of
    them for a line's list of references) or None."""
    where = f"line {spec.line} (id {spec.id!r})"
    image = None
    if isinstance(spec.image, tuple):
        image = [read_image(uri, where)[0] for uri in spec.image]
    elif spec.image is not None:
        image = read_image(spec.image, where)[0]
    last = None if spec.last_image is None else read_image(spec.last_image, where)[0]
    return image, last


def _controls(rows: Sequence[PromptSpec]) -> list | None:
    """Each row's ControlNet inputs (a batch is controlled or not as a whole)."""
    if rows[0].control is None:
        return None
    from stages.generate import control_inputs

    return [control_inputs.to_input(s) for s in rows]


def initial_noise(pipe, spec: PromptSpec, shape: Sequence[int]) -> np.ndarray:
    """The prompt's own initial latents: its .npy files, the rest noise from its seed alone
    (the family joins them: :meth:`Family.initial_latents`)."""
    family, configs = pipe.family, pipe.configs
    settings = dict(spec.micro_conditioning)
    given = read_latent_files(spec, family.latent_inputs(configs, shape, settings))
    return family.initial_latents(configs, shape, spec.seed, given, settings)


@dataclasses.dataclass
class _InFlight:
    batch: Batch
    video: object  # jax.Array [local rows, F, H, W, 3], still computing
    started: float
    stats: dict = dataclasses.field(default_factory=dict)  # step-cache counters per row
    dense: object = None  # the dense render beside a cached one (cache.compare_dense)
    seconds: tuple[float, float] | None = None  # (cached, dense) device seconds when compared
    compiled: bool = False  # the first batch of its group (its timings include compilation)
    # the render's sound, for a family that has it: (waveform [local rows, C, S], sample rate)
    audio: tuple | None = None


def _sample(
    pipe, latents, cond, uncond, scales, first: PromptSpec, scheduler, cache, per_row, plan
):
    """The batch's latents and cache stats with ``plan`` (a ``jaxcore.step_cache.CachePlan``)."""
    schedule = None
    if plan.kind == "magcache":
        schedule = cache.schedule(scheduler, first.flow_shift, first.num_inference_steps)
    return pipe.sample_with_stats(
        latents,
        cond,
        uncond,
        num_inference_steps=first.num_inference_steps,
        cfg_scale=scales,
        shift=first.flow_shift,
        scheduler=scheduler,
        cache=plan,
        cache_schedule=schedule,
        timesteps=first.timesteps,  # a custom list (LTX-Video), in the group key
        **per_row,
    )


def _guidances(pipe, rows: Sequence[PromptSpec]) -> list:
    return [
        pipe.guidance(
            s.guidance_scale,
            s.true_cfg_scale,
            s.guidance_scale_2,
            s.guidance_rescale,
            dict(s.micro_conditioning),
        )
        for s in rows
    ]


def _batch_texts(pipe, batch: Batch) -> list[str]:
    """The texts this process's rows of ``batch`` encode: the prompts, and the negative prompts
    when a row uses CFG (as :meth:`jaxcore.pipeline.Pipeline.conditioning` does)."""
    rows = [batch.row_spec(r) for r in batch.local_rows]
    texts = [s.prompt for s in rows]
    if any(g.uses_cfg for g in _guidances(pipe, rows)):
        texts += [s.negative_prompt for s in rows]
    return texts


def encode_groups(pipe, batches: Sequence[Batch]) -> list[range]:
    """The batches whose texts are encoded together, consecutive from the first: each group
    adds batches while its distinct texts stay within ``ENCODE_BATCH`` (one batch at least).

    A function of the whole plan alone (not of what was encoded before), so a resumed run that
    starts inside a group encodes that group's texts exactly as an uninterrupted run did, and
    its rows round the same way."""
    from jaxcore.pipeline import ENCODE_BATCH

    groups, start, texts = [], 0, {}
    for index, batch in enumerate(batches):
        more = dict.fromkeys(_batch_texts(pipe, batch))
        if index > start and len(texts | more) > ENCODE_BATCH:
            groups.append(range(start, index))
            start, texts = index, {}
        texts |= more
    if start < len(batches):
        groups.append(range(start, len(batches)))
    return groups


def _encode_group(pipe, batches: Sequence[Batch], group: range, max_sequence_length: int):
    texts = [t for i in group for t in _batch_texts(pipe, batches[i])]
    pipe.prefetch_prompts(texts, max_sequence_length, fresh=True)


def _dispatch(
    pipe,
    batch: Batch,
    scheduler: str | None,
    max_sequence_length: int,
    lora_strict: bool,
    cache=None,
) -> _InFlight:
    """Host prep (LoRAs, noise, conditioning) for this process's rows, then queue the device
    work. A batch shares one LoRA set (prompts are grouped by it). ``cache``: the run's
    :class:`stages.generate.caching.CacheRun` (None: no step caching); comparing with the
    dense render times both synchronously."""
    from jaxcore import step_cache

    started = time.perf_counter()
    first = batch.specs[0]
    pipe.apply_loras(first.loras, strict=lora_strict)
    # a batch shares its shape (the group key holds what sets it: size, SHAPE_SETTINGS)
    shape = pipe.latent_shape(
        first.height, first.width, first.num_frames, dict(first.micro_conditioning)
    )
    rows = [batch.row_spec(r) for r in batch.local_rows]
    latents = np.stack([initial_noise(pipe, s, shape) for s in rows])
    guidances = _guidances(pipe, rows)
    cond, uncond, scales = pipe.conditioning(
        [s.prompt for s in rows],
        [s.negative_prompt for s in rows],
        guidances,
        max_sequence_length,
        images=[_images(s) for s in rows],
        size=(first.height, first.width, first.num_frames),
        micro_conditioning=[dict(s.micro_conditioning) for s in rows],
        controls=_controls(rows),
    )
    if first.conditions:  # frame conditions (LTXConditionPipeline): a batch shares them
        size = (first.height, first.width, first.num_frames)
        framed = pipe.family.encode_conditions(pipe, [_conditions(s) for s in rows], *size)
        cond.update(framed)
        if uncond is not None:
            uncond.update(framed)
    plan = step_cache.NO_CACHE if cache is None else cache.plan
    per_row = {  # each row's own seed: samplers that draw noise per step draw it from it
        "seeds": [s.seed for s in rows],
        "guidance_rescale": [g.guidance_rescale for g in guidances],
    }
    args = (pipe, latents, cond, uncond, scales, first, scheduler, cache, per_row)
    z, stats = _sample(*args, plan)
    video = pipe.decode(z, cond)
    audio = pipe.decode_audio(z, cond)  # None for a family without sound
    if cache is None or not cache.config.compare_dense:
        return _InFlight(batch, video, started, stats, audio=audio)
    import jax

    jax.block_until_ready(video)
    cached_done = time.perf_counter()
    reference = pipe.float_reference() if pipe.quantization != "none" else contextlib.nullcontext()
    with reference:  # dense, and with the float weights when the run is quantized
        dense = pipe.decode(_sample(*args, step_cache.NO_CACHE)[0], cond)
        jax.block_until_ready(dense)
    seconds = (cached_done - started, time.perf_counter() - cached_done)
    key = (first.group_key, pipe.denoiser)
    compiled = key not in _TIMED_GROUPS
    _TIMED_GROUPS.add(key)
    return _InFlight(batch, video, started, stats, dense, seconds, compiled, audio)


# (group key, denoiser) pairs whose programs a compared render has compiled in this process
_TIMED_GROUPS: set = set()


def _row_extras(flight: _InFlight) -> list[dict]:
    """Per local row: step-cache counters (and calibration ratios), the dense render."""
    rows = len(flight.batch.local_rows)
    local = {k: _local_rows(v) for k, v in flight.stats.items()}
    dense = None if flight.dense is None else _local_rows(flight.dense)
    extras = []
    for i in range(rows):
        extra: dict = {}
        if local:
            extra["cache"] = {
                "block_stack_runs": int(local["block_stack_runs"][i]),
                "block_stack_skips": int(local["block_stack_skips"][i]),
            }
            for key in ("ratios", "negative_ratios"):
                if key in local:
                    extra["cache"][key] = [round(float(v), 6) for v in local[key][i]]
        if dense is not None:
            extra["dense"] = dense[i]
            cached_s, dense_s = flight.seconds
            batch = max(1, len(flight.batch.specs))
            extra.setdefault("cache", {})  # a quantized run without a step cache has none
            if flight.compiled:  # the group's first batch compiled both programs: untimed
                extra["cache"].update(cached_seconds=None, dense_seconds=None)
            else:
                extra["cache"].update(
                    cached_seconds=cached_s / batch, dense_seconds=dense_s / batch
                )
        extras.append(extra)
    return extras


def _row_audio(pipe, flight: _InFlight) -> list:
    """Per local row its :class:`stages.generate.outputs.Audio`, or None per row for a family
    without sound."""
    from jaxcore.family_types import FamilyError
    from stages.generate.outputs import Audio

    rows = len(flight.batch.local_rows)
    if flight.audio is None:
        return [None] * rows
    waveform, sample_rate = flight.audio
    waveform = _local_rows(waveform)
    if waveform.ndim != 3 or waveform.shape[0] != rows:
        raise FamilyError(
            f"the {pipe.family.name} family's decode_audio gave a waveform of shape "
            f"{waveform.shape}; expected [{rows} rows, channels, samples]"
        )
    try:
        return [Audio(row, sample_rate) for row in waveform]
    except ValueError as err:
        raise FamilyError(f"the {pipe.family.name} family's decode_audio: {err}") from None


def _local_rows(array) -> np.ndarray:
    """This process's rows of a batch-sharded array, in row order, on the host."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
    seen, parts = set(), []
    for shard in shards:
        start = shard.index[0].start or 0
        if start not in seen:
            seen.add(start)
            parts.append(np.asarray(shard.data))
    return np.concatenate(parts)


def render_batches(
    pipe,
    batches: Sequence[Batch],
    *,
    scheduler: str | None,
    max_sequence_length: int,
    on_result: Callable[[PromptSpec, np.ndarray, float, int, dict], dict],
    writer_threads: int = 4,
    progress=None,
    lora_strict: bool = True,
    stop: Callable[[], bool] | None = None,
    cache=None,
    skip: Callable[[Batch], bool] | None = None,
) -> list[dict]:
    """Render every batch; ``on_result(spec, video_fhwc, seconds, batch_size, extra)`` runs in
    the writer pool for each real prompt of this process (``extra``: step-cache counters and
    the dense render, see :func:`_row_extras`; ``audio``, a
    :class:`stages.generate.outputs.Audio`, when the family renders sound). Returns the
    records it produced.
    ``stop()`` true: no further batch starts (the one in flight and its files finish).
    ``skip(batch)`` true: the batch is not rendered (a resumed run's finished batches); it
    still counts in the grouping of texts to encode, as in the run that rendered it."""
    futures: list[Future] = []
    with ThreadPoolExecutor(max_workers=writer_threads) as pool:

        def collect(flight: _InFlight) -> None:
            video = _local_rows(flight.video)  # blocks until the device is done
            seconds = (time.perf_counter() - flight.started) / max(1, len(flight.batch.specs))
            offset = flight.batch.local_rows[0]
            extras = _row_extras(flight)
            for extra, audio in zip(extras, _row_audio(pipe, flight), strict=True):
                if audio is not None:  # absent without sound: the records stay as they were
                    extra["audio"] = audio
            for row, spec in flight.batch.local_real():
                future = pool.submit(
                    on_result,
                    spec,
                    video[row - offset],
                    seconds,
                    len(flight.batch.specs),
                    extras[row - offset],
                )
                if progress is not None:
                    future.add_done_callback(lambda _f: progress.update(1))
                futures.append(future)

        pending: _InFlight | None = None
        groups = encode_groups(pipe, batches)
        encoded = None  # the group whose texts are encoded
        for index, batch in enumerate(batches):
            if skip is not None and skip(batch):
                continue
            if stop is not None and stop():
                break
            if encoded is None or index not in encoded:
                encoded = next(g for g in groups if index in g)
                _encode_group(pipe, batches, encoded, max_sequence_length)
            current = _dispatch(pipe, batch, scheduler, max_sequence_length, lora_strict, cache)
            if pending is not None:
                collect(pending)
            pending = current
        if pending is not None:
            collect(pending)
        return [f.result() for f in futures]
