"""The model families difforge runs, in one static table, and how a model finds its family.

:data:`FAMILIES` maps a family name to its :class:`~jaxcore.families.base.Family`. A diffusers
pipeline directory names its family through ``model_index.json`` ``_class_name``
(:func:`for_pipeline`); a bare denoiser directory through its ``config.json`` ``_class_name``
(:func:`for_denoiser`). An unknown class is an error that lists the supported ones.

Adding a family: write ``jaxcore/families/<name>.py`` (a :class:`Family` subclass over the
models in ``jaxcore/models/``) and add one line to :data:`FAMILIES` (see docs/families.md,
"Adding a model family").
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxcore.families.base import (
    MICRO_CONDITIONING,
    Encoders,
    Family,
    FamilyError,
    Geometry,
    Guidance,
    ImageInputs,
    TensorSpec,
    read_json,
    read_model_index,
)
from jaxcore.families.flux import FluxFamily
from jaxcore.families.flux2 import Flux2Family
from jaxcore.families.flux2_dev import Flux2DevFamily
from jaxcore.families.ltx import LTXFamily
from jaxcore.families.ltx2 import LTX2Family
from jaxcore.families.sd import SDFamily
from jaxcore.families.wan import WanFamily

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        WanFamily(),
        FluxFamily(),
        SDFamily(),
        LTXFamily(),
        Flux2Family(),  # before Flux2DevFamily: a bare Flux2Transformer2DModel is Klein's
        Flux2DevFamily(),
        LTX2Family(),
    )
}


def get(name: str) -> Family:
    """The family called ``name``; an unknown name is an error listing the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise FamilyError(f"unknown model family {name!r}; known: {sorted(FAMILIES)}") from None


def _by_class(class_name: str | None, attribute: str, where: str) -> Family:
    for family in FAMILIES.values():
        if class_name in getattr(family, attribute):
            return family
    supported = sorted(c for f in FAMILIES.values() for c in getattr(f, attribute))
    raise FamilyError(
        f"{where}: _class_name {class_name!r} is not supported; supported: {supported}"
    )


def for_pipeline(directory: str | os.PathLike) -> Family:
    """The family of a diffusers pipeline directory (from ``model_index.json``), checked."""
    index = read_model_index(directory)
    where = str(Path(directory) / "model_index.json")
    family = _by_class(index.get("_class_name"), "pipeline_classes", where)
    family.check_model_index(index, where)
    return family


def load_pipeline(
    path_or_uri_or_repo_id: str | os.PathLike, compute=None, mesh=None, rules=None, **options
):
    """Load a diffusers-format pipeline of any supported family (a local folder, a gs:// URI
    or a Hugging Face repo id) as a :class:`jaxcore.pipeline.Pipeline`.

    The family comes from ``model_index.json``; ``compute`` (a ``ComputeConfig``) defaults to
    float32 with ``dot_product`` attention; ``options`` go to the family's loader (e.g.
    ``keep_float``)."""
    from jaxcore.compute import ComputeConfig
    from jaxcore.pipeline import resolve_pipeline_dir

    directory = resolve_pipeline_dir(path_or_uri_or_repo_id)
    family = for_pipeline(directory)
    return family.load_pipeline(directory, compute or ComputeConfig(), mesh, rules, **options)


def for_denoiser(directory: str | os.PathLike) -> Family:
    """The family of a bare denoiser directory (its ``config.json`` ``_class_name``)."""
    path = Path(directory) / "config.json"
    return _by_class(
        read_json(path, "a denoiser config").get("_class_name"), "denoiser_classes", str(path)
    )


__all__ = [
    "FAMILIES",
    "MICRO_CONDITIONING",
    "Encoders",
    "Family",
    "FamilyError",
    "Geometry",
    "Guidance",
    "ImageInputs",
    "TensorSpec",
    "for_denoiser",
    "for_pipeline",
    "get",
    "load_pipeline",
]
