"""Open the Hugging Face dataset a convert run reads, with its media left undecoded.

What ``dataset.source`` may be (see :class:`stages.convert.config.DatasetConfig`):

- a folder written with ``Dataset.save_to_disk`` -> ``datasets.load_from_disk``;
- any other folder (imagefolder/videofolder with ``metadata.jsonl``/``.csv``, parquet or JSON
  files) -> ``datasets.load_dataset(folder)``, which picks the builder from the files;
- a ``.parquet``/``.json``/``.jsonl``/``.csv`` file -> the matching packaged builder;
- ``gs://...`` -> a cached local copy, then as above;
- a finished ``generate`` artifact (local or ``gs://``) -> its renders, read through its
  manifest: one row per prompt with ``id`` (the prompt id), the media file and its prompt as
  the caption (DreamBooth's class images, rendered by the base model);
- anything else -> a hub id (``revision`` honoured), when the network allows.

``caption``: one caption for every row (DreamBooth's instance / class prompt), in place of the
caption column.

Image/Video columns are cast to ``decode=False`` so rows carry ``{"bytes", "path"}`` and the
stage decodes (and counts failures) itself.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from stages.common.errors import StageInputError
from stages.convert.config import DatasetConfig

log = logging.getLogger(__name__)

FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


@dataclass(frozen=True)
class SourceInfo:
    """What the manifest records about the source."""

    source: str
    revision: str | None
    fingerprint: str
    num_rows: int
    columns: tuple[str, ...]


def _load_local(path: Path, config: DatasetConfig):
    import datasets

    if path.is_dir():
        if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if config.dataset_split not in loaded:
                    raise StageInputError(
                        f"source {config.source}: no split {config.dataset_split!r} "
                        f"(has {sorted(loaded)}); set dataset_split"
                    )
                loaded = loaded[config.dataset_split]
            return loaded
        return datasets.load_dataset(str(path), split=config.dataset_split)
    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise StageInputError(
            f"source {config.source}: cannot read a {path.suffix or 'suffix-less'} file; "
            f"use a folder or one of {sorted(FILE_BUILDERS)}"
        )
    return datasets.load_dataset(builder, data_files=str(path), split=config.dataset_split)


def _generate_artifact(source: str):
    """The generate artifact's manifest when ``source`` is a finished generate run, else None."""
    from jaxcore import artifacts, storage

    if not (storage.is_gcs(source) or Path(source).is_dir()):
        return None
    manifest = artifacts.read_manifest(source)
    if manifest is None or manifest.stage != "generate":
        return None
    artifacts.check_files(manifest)
    return manifest


def _load_renders(manifest, config: DatasetConfig):
    """One row per rendered prompt: ``id``, the media (undecoded ``{bytes, path}``) in
    ``media_column`` and the prompt in ``caption_column``."""
    import datasets

    from jaxcore import storage

    prompts = manifest.summary.get("prompts") or []
    if not prompts:
        raise StageInputError(f"source {config.source}: the generate artifact rendered nothing")
    media = []
    for entry in prompts:
        uri = storage.join(manifest.uri, entry["output"])
        media.append({"bytes": storage.read_bytes(uri), "path": uri})
    return datasets.Dataset.from_dict(
        {
            "id": [str(entry["id"]) for entry in prompts],
            config.media_column: media,
            config.caption_column: [entry["params"]["prompt"] for entry in prompts],
        }
    )


def load_source(config: DatasetConfig):
    """The ``datasets.Dataset`` named by ``config``, media columns undecoded, ``max_items`` kept,
    ``caption`` applied."""
    import datasets

    from jaxcore import storage

    source = config.source
    try:
        renders = _generate_artifact(source)
        if renders is not None:
            dataset = _load_renders(renders, config)
        elif storage.is_gcs(source):
            dataset = _load_local(storage.local_copy(source), config)
        elif Path(source).exists():
            dataset = _load_local(Path(source), config)
        elif source.startswith(("/", "./", "../")):
            raise StageInputError(f"source {source} does not exist")
        else:
            dataset = datasets.load_dataset(
                source, revision=config.revision, split=config.dataset_split
            )
    except StageInputError:
        raise
    except (FileNotFoundError, ValueError, datasets.exceptions.DatasetNotFoundError) as err:
        raise StageInputError(f"source {source}: cannot load the dataset: {err}") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise StageInputError(f"source {source}: got several splits; set dataset_split")
    if config.caption is not None:
        if config.caption_column in dataset.column_names:
            dataset = dataset.remove_columns(config.caption_column)
        dataset = dataset.add_column(config.caption_column, [config.caption] * len(dataset))
    _check_columns(dataset, config)
    if config.max_items is not None and config.max_items < len(dataset):
        dataset = dataset.select(range(config.max_items))
    for column in config.image_columns.values():  # bytes and paths too, decoded as the media are
        dataset = _undecoded(dataset, column)
    if config.audio_column is not None:
        dataset = _undecoded(dataset, config.audio_column)
    return _undecoded(dataset, config.media_column)


def _check_columns(dataset, config: DatasetConfig) -> None:
    columns = list(dataset.column_names)
    keys = ("media_column", "caption_column", "id_column")
    for key in (*keys, "conditioning_image_column", "reference_image_column", "audio_column"):
        name = getattr(config, key)
        if key == "id_column" and name == AUTO:
            continue
        if name is not None and name not in columns:
            hint = " (or id_column=auto)" if key == "id_column" else ""
            raise StageInputError(
                f"source {config.source}: {key}={name!r} is not a column; columns are "
                f"{columns}{hint}"
            )


def _undecoded(dataset, column: str):
    """Cast an Image/Video/Audio column to ``decode=False`` so rows carry bytes and paths
    (an Audio column's decoding needs torchcodec; :func:`stages.convert.media.decode_sound`
    decodes the bytes instead)."""
    import datasets

    feature = dataset.features[column]
    for kind in ("Image", "Video", "Audio"):
        cls = getattr(datasets, kind, None)
        if cls is not None and isinstance(feature, cls) and feature.decode:
            return dataset.cast_column(column, cls(decode=False))
    return dataset


AUTO = "auto"
ID_MEDIA_PATH = "media_path"
ID_CONTENT_HASH = "content_hash"
ID_ROW_INDEX = "row_index"


def id_kind(dataset, config: DatasetConfig) -> str:
    """How rows are identified: ``column:<name>``, ``media_path``, ``content_hash`` or
    ``row_index`` (see ``DatasetConfig.id_column``); recorded in the manifest."""
    if config.id_column is None:
        return ID_ROW_INDEX
    if config.id_column != AUTO:
        return f"column:{config.id_column}"
    if "id" in dataset.column_names:
        return "column:id"
    if len(dataset) and _media_path(dataset[0][config.media_column]):
        return ID_MEDIA_PATH
    return ID_CONTENT_HASH


def _media_path(cell) -> str:
    if isinstance(cell, str):
        return cell
    if isinstance(cell, dict):
        return cell.get("path") or ""
    return ""


def row_id(kind: str, index: int, row: dict, config: DatasetConfig, root: str | None) -> str:
    """The stable id of one row (``row``: column -> undecoded value) under ``kind``."""
    if kind == ID_ROW_INDEX:
        return f"row-{index}"
    if kind.startswith("column:"):
        return str(row[kind.removeprefix("column:")])
    cell = row[config.media_column]
    path = _media_path(cell)
    if kind == ID_MEDIA_PATH and path:
        if root and os.path.isabs(path) and os.path.commonpath([root, path]) == root:
            return os.path.relpath(path, root).replace(os.sep, "/")
        return path
    from stages.convert import media

    try:
        data, _ = media.media_bytes(cell)
    except media.DropItem:  # no media: the caption alone (the row is dropped later anyway)
        data = b""
    caption = str(row.get(config.caption_column) or "")
    digest = hashlib.sha256(data + b"\0" + caption.encode("utf-8")).hexdigest()
    return f"sha256-{digest[:24]}"


def dataset_root(config: DatasetConfig) -> str | None:
    """The local folder media paths are relative to (None: not a local folder)."""
    from jaxcore import storage

    source = config.source
    local = storage.local_copy(source) if storage.is_gcs(source) else Path(source)
    return str(local.resolve()) if local.is_dir() else None


def source_ids(dataset, config: DatasetConfig) -> tuple[list[str], str]:
    """(stable id of every row, the id kind used; see :func:`id_kind`).

    Duplicate ids would let one item land in both splits' bookkeeping: they are an error.
    """
    kind = id_kind(dataset, config)
    root = dataset_root(config)
    if kind == ID_ROW_INDEX:
        ids = [f"row-{i}" for i in range(len(dataset))]
    elif kind.startswith("column:"):
        ids = [str(v) for v in dataset[kind.removeprefix("column:")]]
    else:
        needed = dataset.select_columns([config.media_column, config.caption_column])
        ids = [row_id(kind, i, row, config, root) for i, row in enumerate(needed)]
    seen: dict[str, int] = {}
    for index, sid in enumerate(ids):
        if sid in seen:
            what = {
                ID_MEDIA_PATH: "two rows name the same media file",
                ID_CONTENT_HASH: "two rows have the same media and caption",
            }.get(kind, f"id_column {kind.removeprefix('column:')!r} repeats it")
            raise StageInputError(
                f"source {config.source}: rows {seen[sid]} and {index} have the same id "
                f"{sid!r} ({what}); ids must be unique"
            )
        seen[sid] = index
    return ids, kind


# datasets the driver opened, for DoFns that run in its process (see keep)
_KEPT: dict[str, object] = {}


def keep(dataset) -> str:
    """Keep the driver's ``dataset`` for :func:`kept` in this process; returns its token.

    A DirectRunner job in memory runs its DoFns in the driver's process: they take this copy
    instead of opening the dataset again (for a folder of images, resolving its files takes
    seconds). Workers in other processes (multi_processing, Dataflow) find nothing and open
    their own. :func:`release` the token when the job is done.
    """
    import uuid

    token = uuid.uuid4().hex
    _KEPT[token] = dataset
    return token


def kept(token: str | None):
    """The dataset :func:`keep` kept under ``token`` in this process, else None."""
    return _KEPT.get(token) if token else None


def release(token: str) -> None:
    _KEPT.pop(token, None)


def describe(dataset, config: DatasetConfig) -> SourceInfo:
    return SourceInfo(
        source=config.source,
        revision=config.revision,
        fingerprint=str(getattr(dataset, "_fingerprint", "")),
        num_rows=len(dataset),
        columns=tuple(dataset.column_names),
    )
