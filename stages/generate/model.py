"""The model a generate run renders with: a diffusers pipeline, or a train artifact's checkpoint.

:func:`describe` finds the family, the component configs and the scheduler config without
reading weights, so every prompt line is checked against the model's sizes before anything
loads; :func:`load` then loads the pipeline (and the checkpoint's denoiser).

A ``train`` (or ``evaluate``) artifact supplies the denoiser: its orbax checkpoint
``model.checkpoint`` ("best" as named by evaluation, "final", or a step), restored onto the mesh.
The other components come from ``model.base_pipeline``, or from the diffusers pipeline the run
was fine-tuned from.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxcore import artifacts, families, storage
from jaxcore.artifacts import Manifest
from jaxcore.compute import ComputeConfig
from jaxcore.families.base import read_scheduler_config
from jaxcore.pipeline import Pipeline, resolve_pipeline_dir
from stages.common import checkpoints
from stages.common.errors import StageInputError
from stages.generate import quantized_cache
from stages.generate.config import GenerateConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What renders, known before any weights load."""

    family: families.Family
    pipeline_dir: Path
    configs: dict[str, Any]  # component configs (the checkpoint's denoiser config, if any)
    scheduler_config: dict
    checkpoint: checkpoints.CheckpointSource | None
    provenance: dict
    # model.controlnet resolved to local folders (() = the pipeline's own, if any)
    controlnet: tuple[str, ...] = ()
    # options of the family's load_pipeline the config sets (model.text_encoder_out_layers)
    load_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def has_controlnet(self) -> bool:
        """ControlNets given, or a pipeline folder with its own."""
        from jaxcore import control

        return bool(control.chosen_folders(self.pipeline_dir, self.controlnet))

    @property
    def geometry(self) -> families.Geometry:
        return self.family.geometry(self.configs)

    @property
    def inputs(self) -> dict[str, Manifest]:
        return self.checkpoint.inputs if self.checkpoint is not None else {}

    def latent_shape(
        self, height: int, width: int, num_frames: int, settings: Mapping | None = None
    ) -> tuple[int, ...]:
        """A render's per-example latent shape (``settings``: the prompt's family settings)."""
        settings = dict(settings or {})
        shape = self.family.render_latent_shape(self.configs, height, width, num_frames, settings)
        return tuple(shape)

    def latent_inputs(
        self, height: int, width: int, num_frames: int, settings: Mapping | None = None
    ) -> dict[str, tuple]:
        """The initial arrays a prompt may give (field -> shape), the family's."""
        shape = self.latent_shape(height, width, num_frames, settings)
        return self.family.latent_inputs(self.configs, shape, settings)

    @property
    def image_inputs(self) -> families.ImageInputs:
        return self.family.image_inputs(self.configs)

    def check_guidance(self, specs) -> None:
        """Every prompt's guidance and conditioning settings fit the model (e.g. no
        ``guidance_scale_2`` for a one-expert model, SDXL's micro-conditioning only for SDXL),
        checked before any weights load."""
        for spec in specs:
            try:
                guidance = self.family.guidance(
                    self.configs,
                    guidance_scale=spec.guidance_scale,
                    true_cfg_scale=spec.true_cfg_scale,
                    guidance_scale_2=spec.guidance_scale_2,
                )
                if spec.guidance_rescale:
                    self.family.with_guidance_rescale(self.configs, guidance, spec.guidance_rescale)
                self.family.size_conditioning(
                    self.configs,
                    spec.height,
                    spec.width,
                    [dict(spec.micro_conditioning)],
                    spec.num_frames,
                )
            except families.FamilyError as err:
                raise StageInputError(f"line {spec.line} (id {spec.id!r}): {err}") from None

    def sampling_defaults(self) -> dict[str, Any]:
        """The pipeline's defaults plus its scheduler's shift and name."""
        return {
            **self.family.sampling_defaults(self.configs),
            "flow_shift": self.family.default_shift(self.scheduler_config),
            "scheduler": self.family.default_scheduler(self.scheduler_config),
        }


def checkpoint_artifact(source: str) -> Manifest | None:
    """The manifest when ``source`` is a finished train or evaluate artifact, else None."""
    if not (storage.is_gcs(source) or Path(source).is_dir()):
        return None
    manifest = artifacts.read_manifest(source)
    if manifest is None:
        return None
    artifacts.check_files(manifest)
    if manifest.stage not in ("train", "evaluate"):
        raise StageInputError(
            f"pretrained_model_name_or_path {source} is a {manifest.stage!r} artifact; "
            "expected a diffusers pipeline, a train artifact or an evaluate artifact"
        )
    return manifest


def _base_pipeline(config: GenerateConfig, manifest: Manifest) -> str:
    if config.model.base_pipeline:
        return config.model.base_pipeline
    source = manifest.summary.get("model_source") or {}
    path = source.get("path")
    if source.get("source") == "pretrained" and path:
        for candidate in (Path(path), Path(path).parent):
            if (candidate / "model_index.json").is_file():
                return str(candidate)
    raise StageInputError(
        f"{manifest.uri} was not fine-tuned from a diffusers pipeline: set model.base_pipeline "
        "to a pipeline of its family that supplies the VAE, text encoders and tokenizers"
    )


def _pipeline(path: str) -> tuple[families.Family, Path]:
    try:
        directory = resolve_pipeline_dir(path)
        return families.for_pipeline(directory), directory
    except families.FamilyError as err:
        raise StageInputError(str(err)) from None


def _scheduler_config(config: GenerateConfig, directory: Path) -> dict:
    """The pipeline's scheduler_config.json with ``sampling.scheduler_config`` over it."""
    return {**read_scheduler_config(directory), **config.sampling.scheduler_config}


def describe(config: GenerateConfig) -> ModelSource:
    """Family, configs and provenance of the configured model (no weights read); with
    ``model.controlnet``, its folders (gs:// copied locally)."""
    source = _with_load_options(_describe(config), config)
    given = config.model.controlnet
    if not given:
        return source
    uris = (given,) if isinstance(given, str) else tuple(given)
    folders = tuple(str(_controlnet_dir(uri)) for uri in uris)
    provenance = {**source.provenance, "controlnet": list(uris)}
    return dataclasses.replace(source, controlnet=folders, provenance=provenance)


def _with_load_options(source: ModelSource, config: GenerateConfig) -> ModelSource:
    """``source`` with the load options the config sets; one the model's family does not take
    (its ``load_options``) is refused by name before anything loads."""
    options = {}
    layers = config.model.text_encoder_out_layers
    if layers is not None:
        options["text_encoder_out_layers"] = tuple(layers)
    takes = getattr(source.family, "load_options", ())
    for key in options:
        if key not in takes:
            raise StageInputError(
                f"model.{key}: the {source.family.name} family's pipelines take no {key}; "
                "leave it unset"
            )
    return dataclasses.replace(source, load_options=options)


def _controlnet_dir(uri: str) -> Path:
    """The local folder of ``model.controlnet``: a diffusers ControlNet folder (local, gs://
    copied locally, or a Hub repo id), or a ControlNet run's finished train artifact: its
    exported ControlNet (the manifest's ``controlnet.folder`` under the artifact)."""
    manifest = None
    if storage.is_gcs(uri) or Path(uri).is_dir():
        manifest = artifacts.read_manifest(uri)
    if manifest is not None:
        uri = _exported_controlnet(uri, manifest)
    try:
        return resolve_pipeline_dir(uri)
    except families.FamilyError as err:
        raise StageInputError(f"model.controlnet: {err}") from None


def _exported_controlnet(uri: str, manifest: Manifest) -> str:
    """Where a finished train artifact keeps the ControlNet its run trained; any other
    artifact, or a train artifact without one, is refused by name."""
    artifacts.check_files(manifest)
    if manifest.stage != "train":
        raise StageInputError(
            f"model.controlnet {uri} is a {manifest.stage!r} artifact; expected a ControlNet "
            "folder or the train artifact of a ControlNet run"
        )
    folder = (manifest.summary.get("controlnet") or {}).get("folder")
    if manifest.summary.get("controlnet") is None:
        raise StageInputError(
            f"model.controlnet {uri}: the train artifact trained no ControlNet (its manifest "
            "has no controlnet entry)"
        )
    if not folder:
        raise StageInputError(
            f"model.controlnet {uri}: the ControlNet run exported no ControlNet (its manifest's "
            "controlnet.folder is empty: the run stopped before finishing)"
        )
    return storage.join(uri, folder)


def _describe(config: GenerateConfig) -> ModelSource:
    source = config.pretrained_model_name_or_path
    if checkpoint_artifact(source) is None:
        family, directory = _pipeline(source)
        configs = family.component_configs(directory)
        provenance = {"source": "pipeline", "path": source, "family": family.name}
        return ModelSource(
            family, directory, configs, _scheduler_config(config, directory), None, provenance
        )
    resolved = checkpoints.resolve_checkpoint_source(source, config.model.checkpoint)
    family = resolved.family
    base = _base_pipeline(config, resolved.train)
    base_family, directory = _pipeline(base)
    if base_family != family:
        raise StageInputError(
            f"model.base_pipeline {base} is a {base_family.name!r} pipeline, but "
            f"{resolved.train.uri} trained a {family.name!r} model"
        )
    configs = family.component_configs(directory)
    expert = trained_expert(resolved.train)
    slot = family.denoiser_component
    if expert is not None:
        try:
            slot = family.expert_component(configs, expert)
        except families.FamilyError as err:
            raise StageInputError(
                f"{resolved.train.uri} fine-tuned one expert; base pipeline {base}: {err}"
            ) from None
    configs[slot] = family.denoiser_config(
        resolved.train.summary["model_config"], f"{resolved.train.uri} model_config"
    )
    provenance = {
        "source": "train_artifact",
        "path": resolved.train.uri,
        "step": resolved.step,
        "base": base,
        "family": family.name,
        "expert": expert,
    }
    return ModelSource(
        family, directory, configs, _scheduler_config(config, directory), resolved, provenance
    )


def trained_expert(train_manifest) -> str | None:
    """``high`` / ``low`` when the train run fine-tuned one expert of a two-expert model."""
    return (train_manifest.summary.get("model_source") or {}).get("expert")


def load(
    source: ModelSource,
    compute: ComputeConfig,
    mesh,
    keep_float: str | None = None,
    cached: tuple | None = None,
) -> Pipeline:
    """The pipeline, with the checkpoint's denoiser when the source is a train artifact, and
    the source's scheduler config (``sampling.scheduler_config`` applied). ``keep_float``:
    see :meth:`jaxcore.families.base.Family.load_pipeline`; ``cached``: the quantized
    denoisers' artifact (:func:`cached_weights`), read when finished, else written."""
    try:
        if cached is None:
            pipe = _load(source, compute, mesh, keep_float)
        else:
            uri, made_of = cached
            given = quantized_cache.load(uri, source, compute, mesh)
            if given is not None:
                pipe = source.family.load_pipeline(
                    source.pipeline_dir,
                    compute,
                    mesh,
                    controlnet=source.controlnet,
                    **source.load_options,
                    **given,
                )
            else:
                pipe = _load(source, compute, mesh, keep_float)
                quantized_cache.store(uri, made_of, pipe)
    except families.FamilyError as err:
        if not source.load_options:
            raise
        keys = ", ".join(f"model.{key}" for key in source.load_options)
        raise StageInputError(f"{keys}: {err}") from None
    pipe.scheduler_config = dict(source.scheduler_config)
    return pipe


def cached_weights(source: ModelSource, compute: ComputeConfig, root, keep_float=None):
    """(URI, what it is made of) of the quantized-weights artifact this run reads or writes;
    None when there is none: no cache root, no quantization, the float weights kept (they
    load anyway), or a train artifact's checkpoint (not cached)."""
    if not root or compute.quantization == "none" or keep_float is not None:
        return None
    if source.checkpoint is not None:
        log.warning(
            "model.quantized_cache: a train artifact's checkpoint is quantized as it loads, "
            "not cached (only a diffusers pipeline's denoisers are)"
        )
        return None
    return quantized_cache.describe(root, source, compute)


def _load(source: ModelSource, compute: ComputeConfig, mesh, keep_float) -> Pipeline:
    denoiser = None
    if source.checkpoint is not None:
        _, module, params = checkpoints.restore_denoiser(source.checkpoint, compute, mesh)
        denoiser = (module, params)
        if trained_expert(source.checkpoint.train) == "low":  # the second expert's slot
            return source.family.load_pipeline(
                source.pipeline_dir,
                compute,
                mesh,
                second_denoiser=denoiser,
                keep_float=keep_float,
                controlnet=source.controlnet,
                **source.load_options,
            )
        log.info(
            "generate: denoiser from %s step %d, the rest from %s",
            source.checkpoint.train.uri,
            source.checkpoint.step,
            source.pipeline_dir,
        )
    return source.family.load_pipeline(
        source.pipeline_dir,
        compute,
        mesh,
        denoiser=denoiser,
        keep_float=keep_float,
        controlnet=source.controlnet,
        **source.load_options,
    )
