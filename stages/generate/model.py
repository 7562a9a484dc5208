"""The model a generate run renders with: a diffusers pipeline, or a train artifact's checkpoint.

A ``train`` artifact (a folder with a train ``manifest.json``) supplies the transformer: its
orbax checkpoint ``model.checkpoint`` ("best" as named by evaluation, "final", or a step),
restored onto the mesh. The VAE, text encoder, tokenizer and scheduler come from
``model.base_pipeline``, or from the diffusers pipeline the run was fine-tuned from.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from jaxcore import artifacts, storage
from jaxcore.artifacts import Manifest
from stages.errors import StageInputError
from stages.generate.config import GenerateConfig

log = logging.getLogger(__name__)


def checkpoint_artifact(source: str) -> Manifest | None:
    """The manifest when ``source`` is a finished train or evaluate artifact, else None."""
    if not (storage.is_gcs(source) or Path(source).is_dir()):
        return None
    manifest = artifacts.read_manifest(source)
    if manifest is None:
        return None
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
        "to a Wan pipeline that supplies the VAE, text encoder and tokenizer"
    )


def load(config: GenerateConfig, mesh) -> tuple[object, dict, dict[str, Manifest]]:
    """(pipeline, provenance for the manifest, input artifacts) for the configured model."""
    from jaxcore import wan_pipeline
    from jaxcore.models import wan_transformer as wan

    section = config.model
    source = config.pretrained_model_name_or_path
    common = dict(
        dtype=section.activations_dtype,
        weights_dtype=section.weights_dtype,
        attention=section.attention,
        mesh=mesh,
    )
    if checkpoint_artifact(source) is None:
        pipe = wan_pipeline.load_wan_pipeline(source, **common)
        return pipe, {"source": "pipeline", "path": source}, {}

    from stages.train import checkpointing
    from stages.train.model import resolve_checkpoint_source

    resolved = resolve_checkpoint_source(source, section.checkpoint)
    manifest, step = resolved.train, resolved.step
    base = _base_pipeline(config, manifest)
    pipe = wan_pipeline.load_wan_pipeline(base, **common)
    t_config = wan.WanTransformerConfig.from_dict(manifest.summary["model_config"])
    module = dataclasses.replace(pipe.transformer, config=t_config)
    params = checkpointing.restore_params(
        storage.join(manifest.uri, manifest.summary["checkpoint_dir"]), step, module, mesh
    )
    pipe = dataclasses.replace(pipe, transformer=module, transformer_params=params)
    log.info("generate: transformer from %s step %d, the rest from %s", manifest.uri, step, base)
    provenance = {"source": "train_artifact", "path": manifest.uri, "step": step, "base": base}
    return pipe, provenance, resolved.inputs
