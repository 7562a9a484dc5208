"""Incremental convert: encode only the rows an earlier convert artifact (the *base*) lacks.

A scheduled job (a daily cron over a growing dataset) converts against its last committed
artifact: ``difforge convert ... base=<artifact or pointer> latest=<pointer>``. The new artifact
holds shards for the new rows only; its manifest lists the base's shards too (by URI, size and
checksum, flattened through the base's own base), so train and evaluate read the union through
one manifest. Every artifact carries ``ids.jsonl``, one line per source id it knows::

    {"id": "cat/001.png", "split": "train"}
    {"id": "dog/007.png", "split": "eval", "timestep": 375}
    {"id": "bad.png", "split": "dropped"}

A row keeps its split (a hash of its id) and its eval timestep (dealt when it was first
converted, continuing the base's round-robin, see :func:`stages.convert.split.assign_timesteps`)
forever, so eval losses stay comparable from day to day. Rows dropped as unreadable are known
too (not retried every day). Ids the base knows but the source no longer has are listed in
``removed.jsonl``; with ``drop_removed=true`` readers skip their records.

The ``latest`` pointer (:func:`jaxcore.artifacts.write_pointer`) is written after the manifest:
a run killed before it leaves the pointer on the previous artifact, and its rerun resumes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping, Sequence

from jaxcore import storage
from jaxcore.artifacts import ArtifactError, Manifest, open_artifact, read_manifest, read_pointer
from stages.common import data, records
from stages.common.errors import StageInputError

log = logging.getLogger(__name__)

IDS_FILE = "ids.jsonl"
REMOVED_FILE = data.REMOVED_FILE
DROPPED = "dropped"

# manifest summary keys a base must share with the run built on it (else the union mixes
# incompatible records or moves rows between splits)
COMPATIBLE_KEYS = (
    "family",
    "features",
    "media",
    "latents_normalization",
    "eval_fraction",
    "split_seed",
    "timesteps_list",
)


@dataclasses.dataclass(frozen=True)
class IdEntry:
    """What an artifact knows of one source id."""

    split: str  # "train", "eval" or "dropped"
    timestep: int | None = None

    def to_line(self, sid: str) -> str:
        data = {"id": sid, "split": self.split}
        if self.timestep is not None:
            data["timestep"] = self.timestep
        return json.dumps(data, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Base:
    """The base artifact as an incremental run needs it."""

    manifest: Manifest
    ids: Mapping[str, IdEntry]
    shards: Mapping[str, tuple[dict, ...]]  # split -> [{"uri", "size", "checksum"}]

    @property
    def uri(self) -> str:
        return self.manifest.uri

    def eval_count(self) -> int:
        return sum(1 for e in self.ids.values() if e.split == "eval")


def resolve_base(base: str | None, latest: str | None) -> Manifest | None:
    """The base artifact's manifest: ``base`` names a convert artifact or a pointer to one.

    A pointer that does not exist yet is the first run of a scheduled job when it is the
    ``latest`` pointer this run will write (None: convert everything); any other missing
    base is an error naming it."""
    if not base:
        return None
    target = read_pointer(base)
    if target is None and read_manifest(base) is None:
        if base == latest and not storage.exists(base):
            log.info("convert: %s does not exist yet: a first run converts every row", base)
            return None
        raise StageInputError(
            f"base={base}: neither a finished convert artifact nor an artifact pointer"
        )
    try:
        return open_artifact(target or base, "convert")
    except ArtifactError as err:
        raise StageInputError(f"base={base}: {err}") from None


def read_ids(uri: str, summary: Mapping) -> dict[str, IdEntry]:
    """A convert artifact's ``ids.jsonl`` as ``{id: IdEntry}``."""
    name = summary.get("ids_file")
    if not name:
        raise StageInputError(
            f"base={uri}: the artifact has no {IDS_FILE} (made by an older difforge); "
            "convert it again once without base="
        )
    ids: dict[str, IdEntry] = {}
    path = storage.join(uri, name)
    for number, line in enumerate(storage.iter_lines(path), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            ids[str(data["id"])] = IdEntry(str(data["split"]), data.get("timestep"))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise StageInputError(f"{path}, line {number}: not an id entry ({err})") from None
    return ids


def load_base(manifest: Manifest) -> Base:
    """The base's ids and every shard its manifest reads (its base's included)."""
    shards = {s: tuple(data.split_shards(manifest, s)) for s in records.SPLITS}
    return Base(manifest, read_ids(manifest.uri, manifest.summary), shards)


def check_compatible(base: Manifest, summary: Mapping) -> None:
    """Refuse a base converted with other settings, naming the first key that differs."""
    for key in COMPATIBLE_KEYS:
        ours, theirs = summary.get(key), base.summary.get(key)
        if json.dumps(ours, sort_keys=True) != json.dumps(theirs, sort_keys=True):
            raise StageInputError(
                f"base={base.uri} was converted with {key}={theirs}, this run has "
                f"{key}={ours}: an incremental convert needs the same settings"
            )


def new_row_indices(ids: Sequence[str], base: Base | None) -> list[int]:
    """Indices of the source rows whose id the base does not know (all rows without one)."""
    if base is None:
        return list(range(len(ids)))
    return [i for i, sid in enumerate(ids) if sid not in base.ids]


def removed_ids(ids: Iterable[str], base: Base | None) -> list[str]:
    """Ids the base holds records for that the source no longer has (sorted)."""
    if base is None:
        return []
    present = set(ids)
    return sorted(sid for sid, e in base.ids.items() if e.split != DROPPED and sid not in present)


def new_entries(
    new_ids_by_split: Mapping[str, Sequence[str]],
    dropped_ids: Iterable[str],
    timesteps: Mapping[str, int],
) -> dict[str, IdEntry]:
    """This run's ids: split (or dropped) and, for eval rows, their timestep."""
    dropped = set(dropped_ids)
    out = {}
    for split_name, sids in new_ids_by_split.items():
        for sid in sids:
            if sid in dropped:
                out[sid] = IdEntry(DROPPED)
            else:
                out[sid] = IdEntry(split_name, timesteps.get(sid))
    return out


def write_ids(uri: str, entries: Mapping[str, IdEntry]) -> None:
    """``ids.jsonl``, sorted by id (the same bytes for the same ids)."""
    lines = [entries[sid].to_line(sid) for sid in sorted(entries)]
    storage.write_text(storage.join(uri, IDS_FILE), "".join(f"{line}\n" for line in lines))


def write_removed(uri: str, removed: Sequence[str], entries: Mapping[str, IdEntry]) -> None:
    lines = [json.dumps({"id": sid, "split": entries[sid].split}) for sid in removed]
    storage.write_text(storage.join(uri, REMOVED_FILE), "".join(f"{line}\n" for line in lines))


def dropped_ids(uri: str, dropped_file: str) -> list[str]:
    """Source ids of the rows this run dropped (its ``dropped.jsonl``)."""
    path = storage.join(uri, dropped_file)
    if not storage.exists(path):
        return []
    return [json.loads(line)["source_id"] for line in storage.iter_lines(path) if line.strip()]
