"""Incremental convert (``base=``/``latest=``), as a scheduled job runs it: 30 images, then 5
more, then nothing new, then some removed; train/evaluate's reader sees the union."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from jaxcore import storage
from jaxcore.artifacts import open_artifact, read_pointer
from pipelines.cli import main
from stages.common import data, records
from stages.convert import split
from tests.stages.test_convert_elements import _plain_imagefolder
from tests.stages.test_convert_pipeline import CONFIG, _overrides, _write_encoder_pipeline

NAMES = [f"img{i:02d}.png" for i in range(35)]


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> Path:
    return _write_encoder_pipeline(tmp_path_factory.mktemp("pipeline"))


def _convert(folder, encoder_dir, out, **extra) -> int:
    args = _overrides(folder, encoder_dir, str(out), eval_fraction=0.3, **extra)
    return main(["convert", CONFIG, *args])


def _read(uri: str, split_name: str) -> dict[str, dict]:
    """What train/evaluate read of one split (through the manifest), by source id."""
    spec = data.split_spec(open_artifact(uri, "convert"), split_name)
    dataset = data.tf_dataset(
        spec,
        1,
        seed=0,
        start_step=0,
        shuffle_buffer=1,
        prefetch=1,
        repeat=False,
        with_timesteps=split_name == "eval",
    )
    rows = [
        {k: np.asarray(v)[0] for k, v in batch.items()}
        for batch in data.iterate_numpy(spec, dataset)
    ]
    by_id = {row[records.SOURCE_ID].decode(): row for row in rows}
    assert len(by_id) == len(rows) == spec.records
    return by_id


def _union(uri: str) -> dict[str, dict]:
    train, evals = _read(uri, "train"), _read(uri, "eval")
    assert not set(train) & set(evals)
    return {**train, **evals}


def test_a_daily_job_encodes_only_new_rows(tmp_path, encoder_dir):
    folder = _plain_imagefolder(tmp_path / "imgs", NAMES[:30])
    latest = str(tmp_path / "convert" / "LATEST")
    day = [tmp_path / "convert" / f"day{k}" for k in range(4)]

    # Day 0: the pointer does not exist yet: everything is converted, then the pointer moves.
    assert _convert(folder, encoder_dir, day[0], base=latest, latest=latest) == 0
    first = open_artifact(str(day[0]), "convert")
    assert read_pointer(latest) == str(day[0]) and first.inputs == {}
    assert first.summary["rows_read"] == 30 and first.summary["known_ids"] == 30
    day0 = _union(str(day[0]))
    assert sorted(day0) == NAMES[:30]

    # Day 1: five images arrive; only they are encoded, the reader sees 35.
    _plain_imagefolder(folder, NAMES)
    assert _convert(folder, encoder_dir, day[1], base=latest, latest=latest) == 0
    second = open_artifact(latest, "convert")
    s = second.summary
    assert second.uri == str(day[1]) and second.inputs["base"]["uri"] == str(day[0])
    assert s["rows_read"] == 5
    assert sum(s["splits"][n]["new_records"] for n in records.SPLITS) == 5
    assert sum(s["splits"][n]["records"] for n in records.SPLITS) == 35
    assert s["removed"]["count"] == 0 and s["base"]["uri"] == str(day[0])
    inherited = [e["uri"] for n in records.SPLITS for e in s["splits"][n]["base_shards"]]
    assert inherited and all(u.startswith(str(day[0])) for u in inherited)
    own = [p for p in (day[1]).rglob("*.tfrecord") if p.stat().st_size]
    assert own and all(str(p).startswith(str(day[1])) for p in own)
    day1 = _union(str(day[1]))
    assert sorted(day1) == NAMES
    # the base's records are read as they were (same bytes, same split, same eval timestep)
    for sid, row in day0.items():
        np.testing.assert_array_equal(day1[sid][records.LATENTS], row[records.LATENTS])
        assert day1[sid].get(records.TIMESTEPS) == row.get(records.TIMESTEPS)
    # each row is in the split its id hashes to; eval buckets stay balanced over the union
    evals = _read(str(day[1]), "eval")
    assert all(split.assign_split(sid, 0.3, 0) == "eval" for sid in evals)
    counts = split.bucket_counts(
        [int(r[records.TIMESTEPS]) for r in evals.values()], s["timesteps_list"]
    )
    assert max(counts.values()) - min(counts.values()) <= 1
    # ids.jsonl knows every id with its split and timestep
    ids = [json.loads(x) for x in storage.read_text(str(day[1] / "ids.jsonl")).splitlines()]
    assert [e["id"] for e in ids] == NAMES
    assert {e["id"]: e.get("timestep") for e in ids if e["split"] == "eval"} == {
        sid: int(r[records.TIMESTEPS]) for sid, r in evals.items()
    }

    # Day 2: nothing new: an artifact listing the base's shards, without running a job.
    started = time.perf_counter()
    assert _convert(folder, encoder_dir, day[2], base=latest, latest=latest) == 0
    assert time.perf_counter() - started < 30  # no encoder job ran (the days above take longer)
    third = open_artifact(latest, "convert")
    assert third.summary["rows_read"] == 0 and not list(day[2].rglob("*.tfrecord"))
    # the empty caption's tensors come along from the base (training's caption dropout reads them)
    empty_file = records.EMPTY_PROMPT_FILE
    assert third.summary["empty_prompt"]["file"] == empty_file
    assert (day[2] / empty_file).read_bytes() == (day[1] / empty_file).read_bytes()
    assert sorted(_union(str(day[2]))) == NAMES

    # Day 3: three images are deleted from the source: listed, and left out with drop_removed.
    gone = ["img03.png", "img17.png", "img31.png"]
    for name in gone:
        (folder / name).unlink()
    metadata = [json.loads(x) for x in (folder / "metadata.jsonl").read_text().splitlines()]
    kept = [r for r in metadata if r["file_name"] not in gone]
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert _convert(folder, encoder_dir, day[3], base=latest, latest=latest, drop_removed=True) == 0
    fourth = open_artifact(latest, "convert").summary
    assert fourth["removed"] == {"count": 3, "file": "removed.jsonl", "excluded": True}
    removed = [
        json.loads(x)["id"] for x in storage.read_text(str(day[3] / "removed.jsonl")).splitlines()
    ]
    assert removed == gone
    assert sorted(_union(str(day[3]))) == sorted(set(NAMES) - set(gone))
    assert sum(fourth["splits"][n]["records"] for n in records.SPLITS) == 32


def test_the_train_stage_reads_the_union_through_a_pointer(tmp_path, encoder_dir):
    """``data=<pointer>`` opens the artifact it names; a rerun of the same day is a skip."""
    folder = _plain_imagefolder(tmp_path / "imgs", NAMES[:8])
    base = tmp_path / "base"
    assert _convert(folder, encoder_dir, base) == 0
    _plain_imagefolder(folder, NAMES[:10])
    pointer = str(tmp_path / "LATEST")
    out = tmp_path / "next"
    assert _convert(folder, encoder_dir, out, base=str(base), latest=pointer) == 0
    manifest = open_artifact(pointer, "convert")
    assert manifest.uri == str(out)
    assert sum(len(_read(pointer, n)) for n in records.SPLITS) == 10
    before = (out / "manifest.json").read_bytes()
    assert _convert(folder, encoder_dir, out, base=str(base), latest=pointer) == 0
    assert (out / "manifest.json").read_bytes() == before


def test_a_base_with_other_settings_or_a_missing_base_is_refused(tmp_path, encoder_dir, capsys):
    folder = _plain_imagefolder(tmp_path / "imgs", NAMES[:6])
    base = tmp_path / "base"
    assert _convert(folder, encoder_dir, base) == 0
    capsys.readouterr()
    assert _convert(folder, encoder_dir, tmp_path / "a", base=str(base), split_seed=7) == 2
    assert "split_seed" in capsys.readouterr().err
    missing = str(tmp_path / "nothing")
    assert _convert(folder, encoder_dir, tmp_path / "b", base=missing) == 2
    assert f"base={missing}" in capsys.readouterr().err
    assert _convert(folder, encoder_dir, tmp_path / "c", base=str(base), id_column="null") == 2
    assert "stable ids" in capsys.readouterr().err
    assert not any((tmp_path / n / "manifest.json").exists() for n in "abc")


def test_a_copied_folder_of_daily_artifacts_reads_the_copy(tmp_path, encoder_dir):
    """``cp -r`` of a folder holding a base, its incremental successor and the LATEST pointer,
    the original removed: the copy's pointer opens the copied successor, whose inherited base
    shards are read from the copied base; every record as before."""
    folder = _plain_imagefolder(tmp_path / "imgs", NAMES[:8])
    daily = tmp_path / "daily"
    assert _convert(folder, encoder_dir, daily / "day1") == 0
    _plain_imagefolder(folder, NAMES[:10])
    pointer = str(daily / "LATEST")
    assert (
        _convert(folder, encoder_dir, daily / "day2", base=str(daily / "day1"), latest=pointer) == 0
    )
    before = {k: v[records.LATENTS].tobytes() for k, v in _union(pointer).items()}

    moved = tmp_path / "bucket-in-the-tpu-region" / "daily"
    shutil.copytree(daily, moved)
    shutil.rmtree(daily)
    manifest = open_artifact(str(moved / "LATEST"), "convert")
    assert manifest.uri == str(moved / "day2")
    shards = [s for split in records.SPLITS for s in data.split_spec(manifest, split).shards]
    assert shards and all(s.startswith(str(moved)) for s in shards)
    after = {k: v[records.LATENTS].tobytes() for k, v in _union(str(moved / "LATEST")).items()}
    assert after == before
