"""The embedded defaults: ``tiny`` models and ``synthetic:`` datasets, made locally on demand.

The ``difforge`` command (and the pipeline runner) resolve these names in a stage's config
before the stage runs, so the shipped YAMLs work on a fresh machine with no downloads, while
the stages themselves only ever see real paths:

- ``tiny`` or ``tiny:<family>`` (a model source: ``pretrained_model_name_or_path``,
  ``base_pipeline``): the random-init tiny pipeline of ``configs/models/wan_tiny.yml``
  (``tiny``, ``tiny:wan``) or ``configs/models/flux_tiny.yml`` (``tiny:flux``)
  (:func:`pipelines.embedded.tiny.cached_tiny_pipeline`), built once into the difforge cache;
- ``synthetic:shapes?num_items=N&seed=S&height=H&width=W`` (a dataset ``source``): the
  coloured-shapes imagefolder of :mod:`pipelines.embedded.shapes`, written once into the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import urllib.parse
from pathlib import Path
from typing import Any

from jaxcore import storage
from jaxcore.config import ConfigError

TINY = "tiny"
SYNTHETIC_PREFIX = "synthetic:"
MODEL_FIELDS = ("pretrained_model_name_or_path", "base_pipeline")
SOURCE_FIELDS = ("source",)


def tiny_pipeline(name: str) -> Path:
    """The cached tiny pipeline ``name`` stands for: ``tiny`` (Wan) or ``tiny:<family>``."""
    from pipelines.embedded.tiny import BUILDERS, cached_tiny_pipeline

    family = name.partition(":")[2] or "wan"
    if name.partition(":")[0] != TINY or family not in BUILDERS:
        raise ConfigError(
            f"unknown embedded model {name!r}; use {TINY!r} or tiny:<{'|'.join(BUILDERS)}>"
        )
    return cached_tiny_pipeline(family)


def synthetic_directory(source: str) -> Path:
    """Write (once) and return the folder of a ``synthetic:shapes?...`` source."""
    from pipelines.embedded.shapes import make_shapes_dataset

    parsed = urllib.parse.urlparse(source)
    kind = parsed.path or parsed.netloc
    if kind != "shapes":
        raise ConfigError(f"source {source}: unknown synthetic dataset {kind!r} (use shapes)")
    allowed = {"num_items", "seed", "height", "width", "corrupt", "empty_captions"}
    params: dict[str, int] = {}
    for key, value in urllib.parse.parse_qsl(parsed.query):
        if key not in allowed:
            raise ConfigError(f"source {source}: unknown parameter {key!r}; use {sorted(allowed)}")
        try:
            params[key] = int(value)
        except ValueError:
            raise ConfigError(f"source {source}: {key}={value!r} is not an integer") from None
    params.setdefault("num_items", 32)
    digest = hashlib.sha256(repr(sorted(params.items())).encode()).hexdigest()[:12]
    directory = storage.cache_dir() / "synthetic" / f"shapes-{digest}"
    done = directory / ".complete"
    if not done.exists():
        make_shapes_dataset(directory, **params)
        done.write_text(source)
    return directory


def _resolve_value(name: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if name in MODEL_FIELDS and (value == TINY or value.startswith(TINY + ":")):
        return str(tiny_pipeline(value))
    if name in SOURCE_FIELDS and value.startswith(SYNTHETIC_PREFIX):
        return str(synthetic_directory(value))
    return value


def resolve(config: Any) -> Any:
    """``config`` (a stage's frozen dataclass) with every embedded name replaced by its path."""
    if not dataclasses.is_dataclass(config):
        return config
    changes = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        new = (
            resolve(value) if dataclasses.is_dataclass(value) else _resolve_value(field.name, value)
        )
        if new is not value:
            changes[field.name] = new
    return dataclasses.replace(config, **changes) if changes else config
