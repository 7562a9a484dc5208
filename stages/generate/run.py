"""``difforge generate``: thin entry point; the work is in prompts / model / render / outputs."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import time

from jaxcore import storage
from jaxcore.artifacts import ArtifactError, ArtifactWriter, Manifest
from jaxcore.config import to_dict
from stages.common.errors import StageInputError
from stages.common.preemption import Preempted, Preemption
from stages.generate import caching, control_inputs, outputs
from stages.generate.config import DEFAULT_FPS, DEFAULT_MAX_SEQUENCE_LENGTH, GenerateConfig
from stages.generate.prompts import (
    PromptSpec,
    lora_entry,
    read_prompt_entries,
    resolve_prompts,
)

log = logging.getLogger(__name__)


def _run_fingerprint(config: GenerateConfig, scheduler: str, model_frame_rate) -> str:
    """What, besides a prompt's own parameters, decides its pixels (and its MP4's rate)."""
    compute = to_dict(config.compute)
    if compute.get("quantization") == "none":  # earlier runs' fingerprints hold
        del compute["quantization"]
    payload = {
        "model": config.pretrained_model_name_or_path,
        "checkpoint": config.model.checkpoint,
        "base_pipeline": config.model.base_pipeline,
        "compute": compute,
        "scheduler": scheduler,
        "max_sequence_length": config.sampling.max_sequence_length,
        "fps": _fingerprint_fps(config.output.fps, model_frame_rate),
        "save_arrays": config.output.save_arrays,
    }
    if config.sampling.scheduler_config:  # only when set: earlier runs' fingerprints hold
        payload["scheduler_config"] = config.sampling.scheduler_config
    if config.model.text_encoder_out_layers is not None:  # likewise
        payload["text_encoder_out_layers"] = list(config.model.text_encoder_out_layers)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _fingerprint_fps(fps: float | None, model_frame_rate) -> float | int | str:
    """The MP4 rate as the run fingerprint holds it: an integral rate as an int (earlier runs'
    ``fps: 16`` holds), ``"frame_rate"`` where each prompt's frame rate sets it."""
    if fps is None:
        return "frame_rate" if model_frame_rate is not None else DEFAULT_FPS
    return int(fps) if float(fps).is_integer() else float(fps)


def playback_fps(fps: float | None, spec: PromptSpec, model_frame_rate) -> float:
    """A prompt's MP4 rate: ``output.fps`` where set, else its ``frame_rate`` (the line's or
    the config's, else the model's default) where the model takes one, else
    :data:`DEFAULT_FPS`."""
    if fps is not None:
        return fps
    if model_frame_rate is None:
        return DEFAULT_FPS
    return float(dict(spec.micro_conditioning).get("frame_rate", model_frame_rate))


def _fingerprint(
    spec: PromptSpec,
    run_fingerprint: str,
    lora_checksums: dict,
    image_checksums: dict,
    cache_fingerprint: dict | None = None,
) -> str:
    """The prompt's own parameters, its LoRA and image files' contents, the run's settings
    and the step cache's (with the MagCache ratios its group uses)."""
    payload = {
        "run": run_fingerprint,
        "params": spec.params(),
        "lora_sha256": [lora_checksums[use[0]] for use in spec.loras],
        "image_sha256": [image_checksums.get(u) for u in (*spec.image_uris, spec.last_image) if u],
    }
    if spec.conditions:  # frame conditions' files (absent otherwise: earlier runs match)
        payload["condition_sha256"] = [image_checksums.get(c[1]) for c in spec.conditions]
    if spec.control is not None:  # the control images' files
        payload["control_sha256"] = [image_checksums.get(u) for u in spec.control.images]
    if cache_fingerprint:
        payload["cache"] = cache_fingerprint
    blob = json.dumps(payload, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _prompt_file_sha256(uri: str) -> str:
    return hashlib.sha256(storage.read_bytes(uri)).hexdigest()


def run(config: GenerateConfig, *, force: bool = False) -> Manifest:
    """Render every prompt not already rendered (same fingerprint), then commit the artifact."""
    import jax

    from jaxcore.sharding import make_mesh
    from stages.common.distributed import maybe_initialize_distributed
    from stages.generate import model, render

    maybe_initialize_distributed()
    entries = read_prompt_entries(config.prompt_file)  # syntax errors before anything else
    source = model.describe(config)  # the family and its sizes, no weights
    config = _with_text_length(config, source)
    specs, scheduler = _checked_prompts(config, entries, source)
    cache = caching.prepare(config.cache)
    prompt_sha = _prompt_file_sha256(config.prompt_file)
    writer = ArtifactWriter(config.output_dir, "generate", config, source.inputs)
    done = writer.existing(force)
    if done is not None:
        if done.summary.get("prompt_file_sha256") != prompt_sha:
            raise ArtifactError(
                f"{writer.uri} is a finished run of an earlier version of {config.prompt_file}; "
                "pass --force to render what changed, or choose another output_dir"
            )
        log.info("generate: %s is already finished (same config and prompts)", done.uri)
        return done

    render.check_latent_files(specs, source.latent_inputs)  # also before any rendering
    render.check_memory(specs, source.latent_shape, config.prompt_file)
    image_sha = render.check_image_files(specs)
    control_inputs.check_files(specs, image_sha)
    keep_float = _keep_float(config, specs)
    cached = model.cached_weights(source, config.compute, config.model.quantized_cache, keep_float)
    pipe = model.load(source, config.compute, make_mesh(config.mesh), keep_float, cached)
    provenance = dict(source.provenance)
    if cached is not None:  # the quantized denoisers' artifact, read or written
        provenance["quantized_weights"] = cached[0]
    # every LoRA set is read and checked against the model before anything renders
    pipe.check_loras({s.loras for s in specs}, strict=config.model.lora_strict)
    lora_sha = {path: lora.checksum for path, lora in pipe.lora_files.items()}
    model_frame_rate = source.sampling_defaults().get("frame_rate")  # None: the model has none
    fingerprint = functools.partial(
        _spec_fingerprint,
        config,
        cache,
        scheduler,
        _run_fingerprint(config, scheduler, model_frame_rate),
        lora_sha,
        image_sha,
    )
    if jax.process_index() == 0:
        outputs.remove_stale_partials(writer.uri)
    _barrier("generate-start")
    finished = outputs.load_records(writer.uri)
    todo = [s for s in specs if finished.get(s.name, {}).get("fingerprint") != fingerprint(s)]
    log.info("generate: %d prompts, %d to render", len(specs), len(todo))
    write = functools.partial(
        _write_prompt, config, writer.uri, scheduler, lora_sha, fingerprint, model_frame_rate
    )
    started = time.perf_counter()
    _render(config, pipe, specs, todo, finished, write, scheduler, cache, writer.uri)
    elapsed = time.perf_counter() - started
    _barrier("generate-rendered")
    if jax.process_index() != 0:
        return None  # process 0 writes the gallery and the manifest
    checks = (fingerprint, lora_sha, prompt_sha)
    return _finish(config, writer, specs, checks, provenance, len(todo), elapsed, scheduler)


def _with_text_length(config: GenerateConfig, source) -> GenerateConfig:
    """``config`` with ``sampling.max_sequence_length`` resolved: the config's, else the
    pipeline's default (its family's sampling default, else DEFAULT_MAX_SEQUENCE_LENGTH)."""
    if config.sampling.max_sequence_length is not None:
        return config
    length = source.sampling_defaults().get("max_sequence_length", DEFAULT_MAX_SEQUENCE_LENGTH)
    sampling = dataclasses.replace(config.sampling, max_sequence_length=int(length))
    return dataclasses.replace(config, sampling=sampling)


def _keep_float(config: GenerateConfig, specs) -> str | None:
    """Where a quantized run keeps the float weights: beside the quantized ones for the
    quality gate's float render, on the host when a prompt's LoRAs merge into them, else
    nowhere (see :class:`jaxcore.pipeline.FloatWeights`)."""
    if config.compute.quantization == "none":
        return None
    if config.cache.compare_dense:
        return "device"
    return "host" if any(s.loras for s in specs) else None


def _checked_prompts(config: GenerateConfig, entries, source):
    """(the prompt file's specs, each checked against the model, the scheduler's name)."""
    defaults = source.sampling_defaults()
    default_loras = tuple((lora.path, lora.scale, lora.expert) for lora in config.model.loras)
    specs = resolve_prompts(
        config.prompt_file,
        entries,
        config.sampling,
        defaults,
        source.geometry,
        default_loras,
        source.image_inputs,
        config.control,
    )
    specs = _checked_control(specs, source)
    specs = _sized_from_images(specs, source)
    source.check_guidance(specs)
    return specs, config.sampling.scheduler or defaults["scheduler"]


def _checked_control(specs, source) -> list:
    """Control fields only for a model with ControlNets, and then on every line; sizes from
    the control images where the family's pipelines take them so (read now: a missing image
    fails before anything loads)."""
    # a run reads the control images afresh (a rerun in this process may find them changed);
    # then once: sizes, checks, render and writer share the cache
    control_inputs.control_image.cache_clear()
    controlled = source.has_controlnet
    for spec in specs:
        if (spec.control is not None) != controlled:
            where = f"{spec.id!r} (line {spec.line})"
            raise StageInputError(
                f"prompt {where}: "
                + (
                    "control_image given, but the model has no ControlNet (set model.controlnet)"
                    if not controlled
                    else "the model has ControlNets: every line needs a control_image"
                )
            )
    if not controlled or not source.family.size_from_control_image:
        return specs
    sized = control_inputs.sized_from_images(specs, source.geometry)
    for spec in sized:
        try:
            source.geometry.check(spec.height, spec.width, spec.num_frames)
        except ValueError as err:
            raise StageInputError(f"line {spec.line} (id {spec.id!r}): {err}") from None
    return sized


def _sized_from_images(specs, source) -> list:
    """The sides a line leaves unset, for a model that sizes a render by its first image
    (Flux.2 [klein]: the first reference as the pipeline prepares it), taken from that image
    (read now: a missing image fails before anything loads)."""
    from jaxcore.families import FamilyError
    from stages.generate.images import read_image

    out = []
    for spec in specs:
        if spec.size_from_image:
            where = f"line {spec.line} (id {spec.id!r})"
            width, height = read_image(spec.image_uris[0], where)[0].size
            try:
                height, width = source.family.size_from_image(source.configs, width, height)
                sides = {"height": height, "width": width}
                spec = dataclasses.replace(spec, **{s: sides[s] for s in spec.size_from_image})
                source.geometry.check(spec.height, spec.width, spec.num_frames)
            except (ValueError, FamilyError) as err:
                raise StageInputError(f"{where}: image {spec.image_uris[0]}: {err}") from None
        out.append(spec)
    return out


def _spec_fingerprint(
    config, cache, scheduler, run_fp, lora_sha, image_sha, spec: PromptSpec
) -> str:
    """What a prompt's render depends on (a finished render with the same one is kept)."""
    extra = cache.fingerprint(scheduler, spec.flow_shift, spec.num_inference_steps)
    if config.cache.compare_dense:
        extra["compare_dense"] = True
    return _fingerprint(spec, run_fp, lora_sha, image_sha, extra)


def _write_prompt(
    config,
    uri,
    scheduler,
    lora_sha,
    fingerprint,
    model_frame_rate,
    spec: PromptSpec,
    video,
    seconds,
    batch_size,
    extra,
) -> dict:
    """A rendered prompt's files and its record (with the step cache's figures, with
    ``compare_dense`` the dense render's, and the render's sound where the family has it)."""
    import jax

    record = {
        "id": spec.id,
        "name": spec.name,
        "index": spec.index,
        "line": spec.line,
        "params": spec.params(),
        "scheduler": scheduler,
        "loras": [{**lora_entry(*use), "sha256": lora_sha[use[0]]} for use in spec.loras],
        "fingerprint": fingerprint(spec),
        "seconds": seconds,
        "batch_size": batch_size,
        "process_index": jax.process_index(),
    }
    if config.compute.quantization != "none":  # what ran: the denoisers' quantization
        record["quantization"] = config.compute.quantization
    if "cache" in extra:
        record["cache"] = {"kind": config.cache.kind, **extra["cache"]}
    if "dense" in extra:
        record["cache"].update(outputs.write_dense(uri, spec.name, video, extra["dense"]))
    edge_maps = control_inputs.write_edge_maps(uri, spec)
    if edge_maps:  # the preprocessed control images the ControlNets saw
        record["control_outputs"] = edge_maps
    return outputs.write_prompt_outputs(
        uri,
        record,
        video,
        fps=playback_fps(config.output.fps, spec, model_frame_rate),
        save_arrays=config.output.save_arrays,
        thumbnail_size=config.output.thumbnail_size,
        audio=extra.get("audio"),
    )


def _render(config, pipe, specs, todo, finished, write_outputs, scheduler, cache, uri) -> None:
    """Render this process's share of the batches that hold an unfinished prompt; SIGTERM
    stops after the batch in flight (:class:`Preempted`)."""
    import jax
    from tqdm import tqdm

    from stages.generate import render

    batch_size = render.global_batch_size(config.per_device_batch_size, pipe.batch_ways)
    # The batches an uninterrupted run renders, less those wholly finished: a resumed run
    # renders each prompt in the same batch as an uninterrupted one (the same bytes), and
    # writes only the unfinished ones
    pending = {s.name for s in todo}
    # a model that takes several reference images batches prompts whose references share sizes
    specs = render.with_image_sizes(specs, pipe.image_inputs.max_images)
    batches = render.plan_batches(
        specs, batch_size, pipe.batch_ways, jax.process_index(), jax.process_count()
    )

    def finished_batch(batch: render.Batch) -> bool:
        return not any(spec.name in pending for spec in batch.specs)

    def write(spec: PromptSpec, video, seconds: float, batch_size: int, extra: dict) -> dict:
        if spec.name not in pending:
            return finished[spec.name]  # re-rendered for its batch's sake only
        return write_outputs(spec, video, seconds, batch_size, extra)

    mine = sum(len(b.local_real()) for b in batches if not finished_batch(b))
    with (
        Preemption("generate") as preemption,
        tqdm(total=mine, unit="prompt", desc="generate", disable=None) as progress,
    ):
        records = render.render_batches(
            pipe,
            batches,
            scheduler=scheduler,
            max_sequence_length=config.sampling.max_sequence_length,
            on_result=write,
            writer_threads=config.output.writer_threads,
            progress=progress,
            lora_strict=config.model.lora_strict,
            stop=lambda: preemption.requested,
            cache=cache if config.cache.enabled or config.cache.compare_dense else None,
            skip=finished_batch,
        )
    if preemption.requested:
        raise Preempted(
            f"generate: stopped by SIGTERM with {len(records)} of this process's {mine} prompts "
            f"rendered (kept in {uri}); rerun to render the rest"
        )


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _finish(config, writer, specs, checks, provenance, rendered, elapsed, scheduler):
    """Check every prompt has its record, write the contact sheet and gallery (and the cache
    report), then commit; a prompt below the cache's quality floor fails the run after the
    report is written."""
    fingerprint, lora_sha, prompt_sha = checks
    records = outputs.load_records(writer.uri)
    ordered = []
    for spec in specs:
        record = records.get(spec.name)
        if record is None or record.get("fingerprint") != fingerprint(spec):
            raise ArtifactError(
                f"{writer.uri}: prompt {spec.id!r} (line {spec.line}) has no finished output"
            )
        ordered.append(record)
    sheet = outputs.contact_sheet(
        writer.uri, ordered, config.output.contact_sheet_columns, config.output.thumbnail_size
    )
    storage.write_bytes(writer.file(outputs.CONTACT_SHEET), sheet)
    title = config.run_name or f"difforge generate: {config.prompt_file}"
    report = caching.quality_summary(ordered, config.cache, config.compute.quantization)
    if report is not None:
        outputs.write_cache_report(writer.uri, ordered, report)
    storage.write_text(
        writer.file(outputs.GALLERY), outputs.gallery_html(ordered, title, cache_report=report)
    )
    summary = {
        "prompt_file": config.prompt_file,
        "prompt_file_sha256": prompt_sha,
        "model": provenance,
        "loras": [{"path": p, "sha256": sha} for p, sha in sorted(lora_sha.items())],
        "num_prompts": len(specs),
        "rendered_this_run": rendered,
        "reused": len(specs) - rendered,
        "render_seconds": round(elapsed, 3),
        "contact_sheet": outputs.CONTACT_SHEET,
        "gallery": outputs.GALLERY,
        "prompts": [
            {
                "id": r["id"],
                "name": r["name"],
                "output": r["output"],
                "array": r["array"],
                "seed": r["params"]["seed"],
                "params": r["params"],
                "loras": r.get("loras", []),
                "seconds": round(r["seconds"], 4),
                **({"audio": r["audio"]} if "audio" in r else {}),  # a render with sound
            }
            for r in ordered
        ],
    }
    if config.cache.enabled or report is not None:
        summary["cache"] = _cache_summary(config, ordered, report)
    if config.cache.kind == "calibrate":
        summary[caching.CALIBRATION_KEY] = caching.calibration_summary(ordered, scheduler)
    if report is not None and report["below_floor"]:
        raise StageInputError(
            f"generate: the {report['compared']} render of {len(report['below_floor'])} prompt(s) "
            f"{report['below_floor'][:5]} is below the quality floor (min_psnr="
            f"{config.cache.min_psnr}, min_ssim={config.cache.min_ssim}; lowest PSNR "
            f"{report['min_psnr']:.2f} dB, SSIM {report['min_ssim']:.4f}); see "
            f"{writer.file(outputs.CACHE_REPORT)}. Nothing was committed."
        )
    return writer.commit(summary)


def _cache_summary(config, records, report) -> dict:
    """The manifest's step-cache section: settings, block-stack evaluations, the quality
    report, and a calibrate run's ratios."""
    runs = sum(r["cache"].get("block_stack_runs", 0) for r in records)
    skips = sum(r["cache"].get("block_stack_skips", 0) for r in records)
    out = {
        "config": to_dict(config.cache),
        "block_stack_runs": runs,
        "block_stack_skips": skips,
        "evaluation_ratio": (runs + skips) / runs if runs else None,
    }
    if report is not None:
        out["quality"] = {k: v for k, v in report.items() if k != "prompts"}
        out["report"] = outputs.CACHE_REPORT
    return out


def calibrate(config: GenerateConfig, *, force: bool = False) -> Manifest:
    """``difforge calibrate``: generate densely, recording MagCache's per-step ratios of every
    prompt; the manifest's ``magcache_calibration`` is what ``cache.calibration=<this
    artifact>`` reads (see :mod:`stages.generate.caching`)."""
    import dataclasses

    from jaxcore.step_cache import CacheConfig

    if config.cache.kind not in ("none", "calibrate"):
        raise StageInputError(
            f"difforge calibrate measures dense renders; cache.kind={config.cache.kind} is not "
            "allowed here"
        )
    return run(dataclasses.replace(config, cache=CacheConfig(kind="calibrate")), force=force)
