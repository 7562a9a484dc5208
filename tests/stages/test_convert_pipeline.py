"""Convert stage, tiers 2-3: model handler and DoFns called directly, the Beam graph on a
TestPipeline, and ``difforge convert`` end to end (local folder and gs://), read back with tf.data.

The encoders are a tiny random-init Wan VAE + UMT5 + tokenizer written in diffusers layout by
:func:`_write_encoder_pipeline`, with non-trivial ``latents_mean``/``latents_std`` so the stored
normalisation is actually checked.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore import storage
from pipelines.cli import main
from pipelines.embedded import shapes as synthetic
from stages.common import records
from stages.convert import media, split
from stages.convert.config import EncoderConfig, MediaConfig, SplitConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/stages/convert.yml")
LATENTS_MEAN = (0.1, -0.2, 0.3, 0.05)
LATENTS_STD = (0.5, 2.0, 1.5, 0.8)
SEQ_LEN = 16
HEIGHT = WIDTH = 16
# Records hold the same fp32 computation as a direct call, on a batch padded differently:
# XLA on CPU may reorder reductions per batch shape, so allow fp32 round-off, not more.
ATOL = 1e-5
TEXT = "encoder_hidden_states"


def _write_encoder_pipeline(root: Path) -> Path:
    """A tiny random-init Wan pipeline (diffusers layout) with non-trivial latent statistics."""
    from jaxcore.model_configs import read_model_yaml
    from pipelines.embedded.tiny import build_tiny_wan_pipeline

    _, sections = read_model_yaml(REPO / "configs/models/wan_tiny.yml")
    sections["vae"] = dataclasses.replace(
        sections["vae"], latents_mean=LATENTS_MEAN, latents_std=LATENTS_STD
    )
    sections["text_encoder"] = dataclasses.replace(sections["text_encoder"], vocab_size=256)
    return build_tiny_wan_pipeline(
        root, model_config={name: c.to_dict() for name, c in sections.items()}, seed=1
    )


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory) -> Path:
    return _write_encoder_pipeline(tmp_path_factory.mktemp("pipeline"))


@pytest.fixture(scope="module")
def encoder_config(encoder_dir) -> EncoderConfig:
    return EncoderConfig(
        pretrained_model_name_or_path=str(encoder_dir), max_sequence_length=SEQ_LEN, batch_size=4
    )


@pytest.fixture(scope="module")
def direct(encoder_dir):
    """Direct jaxcore encoders (no Beam, no batching): the oracle for record contents."""
    from jaxcore import text
    from jaxcore.models.umt5 import load_umt5
    from jaxcore.models.wan_vae import encode, load_wan_vae, normalize_latents

    vae, vae_params = load_wan_vae(encoder_dir / "vae")
    t5, t5_params = load_umt5(encoder_dir / "text_encoder")
    tokenizer = text.load_tokenizer(encoder_dir / "tokenizer")

    def latents(video):
        z = encode(vae, vae_params, video[None]).mean
        return np.asarray(normalize_latents(z, vae.config))[0]

    def embeddings(caption):
        emb, _ = text.encode_prompts(tokenizer, t5, t5_params, [caption], SEQ_LEN)
        return emb[0]

    return latents, embeddings


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory) -> Path:
    return synthetic.make_shapes_dataset(
        tmp_path_factory.mktemp("shapes"),
        num_items=14,
        height=24,
        width=20,
        seed=3,
        corrupt=1,
        empty_captions=1,
    )


def _video(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (3, 1, HEIGHT, WIDTH)).astype(np.float32)


# ---------------------------------------------------------------------------- tier 2: direct


def test_handler_matches_direct_encoding(encoder_config, direct):
    from jaxcore.compute import ComputeConfig
    from stages.convert.encode import EncoderHandler, plan_encoders

    plan = plan_encoders(encoder_config, HEIGHT, WIDTH, 1)
    assert plan.family == "wan"
    assert plan.shapes == {
        "latents": (4, 1, HEIGHT // 2, WIDTH // 2),
        "encoder_hidden_states": (SEQ_LEN, 32),
    }
    handler = EncoderHandler(encoder_config, ComputeConfig(), plan)
    model = handler.load_model()
    import weakref

    weakref.ref(model)  # Beam's shared model cache keeps weak references
    assert handler.batch_elements_kwargs() == {"min_batch_size": 4, "max_batch_size": 4}
    captions = ["a red circle on a blue background", "a green square", "three small dots"]
    batch = [
        {"source_id": f"s{i}", "caption": c, "video": _video(i)} for i, c in enumerate(captions)
    ]  # 3 items: padded to the batch size 4
    out = list(handler.run_inference(batch, model))
    assert [o["source_id"] for o in out] == ["s0", "s1", "s2"]
    latents_fn, text_fn = direct
    for item, result in zip(batch, out, strict=True):
        tensors = result["tensors"]
        np.testing.assert_allclose(tensors["latents"], latents_fn(item["video"]), atol=ATOL)
        np.testing.assert_allclose(
            tensors["encoder_hidden_states"], text_fn(item["caption"]), atol=ATOL
        )
        assert np.abs(tensors["latents"]).max() > 1e-3  # not trivially zero


def test_sizes_the_model_cannot_encode_are_refused_before_the_job(encoder_config):
    from stages.convert.encode import EncoderLoadError, plan_encoders

    with pytest.raises(EncoderLoadError, match="num_frames must be 1, 3, 5"):
        plan_encoders(encoder_config, HEIGHT, WIDTH, 4)
    with pytest.raises(EncoderLoadError, match="height must be a positive multiple of 4"):
        plan_encoders(encoder_config, 18, WIDTH, 1)


def test_prepare_item_dofn_emits_items_and_drop_reasons():
    import apache_beam as beam

    from stages.convert.pipeline import DROPPED_TAG, PrepareItem

    good = synthetic.make_items(1, 20, 20, seed=0)[0]
    dofn = PrepareItem(MediaConfig(height=16, width=16))
    rows = [
        ("ok", {"bytes": good["image_bytes"], "path": "ok.png"}, "  a red circle "),
        ("bad", {"bytes": synthetic.CORRUPT_BYTES, "path": "bad.png"}, "a caption"),
        ("empty", {"bytes": good["image_bytes"], "path": "e.png"}, ""),
        ("none", None, "a caption"),
    ]
    outputs = [out for row in rows for out in dofn.process(row)]
    assert outputs[0]["source_id"] == "ok" and outputs[0]["caption"] == "a red circle"
    assert outputs[0]["video"].shape == (3, 1, 16, 16)
    dropped = outputs[1:]
    assert all(isinstance(d, beam.pvalue.TaggedOutput) and d.tag == DROPPED_TAG for d in dropped)
    assert [(d.value["source_id"], d.value["reason"]) for d in dropped] == [
        ("bad", media.UNDECODABLE_MEDIA),
        ("empty", media.EMPTY_CAPTION),
        ("none", media.MISSING_MEDIA),
    ]


def test_record_dofns_route_by_split_and_add_eval_timesteps():
    """SplitRecords serializes train items at once and passes eval items on; MakeEvalRecord
    gives each its timestep."""
    import tensorflow as tf

    from stages.convert.pipeline import MakeEvalRecord, SplitRecords

    cfg = SplitConfig(eval_fraction=0.5, split_seed=0, timesteps_list=(100, 200))
    ids = [f"id{i}" for i in range(8)]
    eval_ids = [i for i in ids if split.assign_split(i, 0.5, 0) == "eval"]
    assert 0 < len(eval_ids) < len(ids)
    timesteps = split.assign_timesteps(eval_ids, cfg.timesteps_list)
    assert set(timesteps.values()) == {100, 200}
    splitter, eval_maker = SplitRecords(cfg), MakeEvalRecord(cfg)
    for sid in ids:
        tensors = {
            "latents": np.ones((4, 1, 2, 2), np.float32),
            "encoder_hidden_states": np.zeros((3, 5), np.float32),
        }
        item = {"source_id": sid, "caption": "c", "tensors": tensors}
        (out,) = splitter.process(item)
        assert out.tag == split.assign_split(sid, 0.5, 0)
        if out.tag == "eval":
            assert out.value is item
            (pair,) = eval_maker.process(item, timesteps)
        else:
            pair = out.value
        key, serialized = pair
        assert key == sid
        shapes = {name: value.shape for name, value in tensors.items()}
        parsed = records.parse_example(
            tf.constant(serialized), shapes, with_timesteps=out.tag == "eval"
        )
        assert parsed[records.SOURCE_ID].numpy().decode() == sid
        if out.tag == "eval":
            assert int(parsed[records.TIMESTEPS]) == timesteps[sid]


# ---------------------------------------------------------------------------- tier 3: graph


@pytest.mark.parametrize("large_model", [False, True], ids=["encode_batches", "run_inference"])
def test_graph_on_test_pipeline(shapes_dir, encoder_config, direct, large_model):
    """Both encoding paths: the records of each split, the dropped rows, and the empty
    caption's text tensors (the direct encoder's, no latents)."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.testing.test_pipeline import TestPipeline
    from apache_beam.testing.util import assert_that, equal_to

    from jaxcore.compute import ComputeConfig
    from stages.convert.config import BeamConfig, DatasetConfig
    from stages.convert.encode import EncoderHandler
    from stages.convert.pipeline import DROPPED_TAG, build_graph, local_runner

    dataset_config = DatasetConfig(source=str(shapes_dir))
    items = synthetic.make_items(14, 24, 20, seed=3, corrupt=1, empty_captions=1)
    bad = {
        i["id"]: media.UNDECODABLE_MEDIA if i["image_bytes"] == synthetic.CORRUPT_BYTES else None
        for i in items
    }
    bad.update({i["id"]: media.EMPTY_CAPTION for i in items if not i["text"]})
    good = sorted(sid for sid, reason in bad.items() if reason is None)
    split_cfg = SplitConfig(eval_fraction=0.4, timesteps_list=(100, 500, 900))
    expected = {
        s: [g for g in good if split.assign_split(g, 0.4, 0) == s] for s in ("train", "eval")
    }
    assert expected["train"] and expected["eval"]

    def ids_of(pair):
        import tensorflow as tf

        sid, serialized = pair
        example = tf.train.Example.FromString(serialized)
        assert example.features.feature[records.SOURCE_ID].bytes_list.value[0].decode() == sid
        return sid

    # the engine runner=DirectRunner runs, not Beam's DirectRunner (which tries Prism first)
    runner = local_runner(BeamConfig(), PipelineOptions())
    with TestPipeline(runner=runner) as pipeline:
        outputs = build_graph(
            pipeline,
            num_rows=14,
            dataset_config=dataset_config,
            media_config=MediaConfig(height=HEIGHT, width=WIDTH),
            split_config=split_cfg,
            handler=EncoderHandler(
                dataclasses.replace(encoder_config, large_model=large_model), ComputeConfig()
            ),
        )
        _, embeddings = direct
        expected_empty = embeddings("")

        def check_empty(items):
            (item,) = items
            assert item["source_id"] == records.EMPTY_PROMPT_ID and item["caption"] == ""
            assert set(item["tensors"]) == {"encoder_hidden_states"}
            np.testing.assert_allclose(
                item["tensors"]["encoder_hidden_states"], expected_empty, atol=1e-6
            )

        assert_that(outputs["empty_prompt"], check_empty, label="CheckEmptyPrompt")
        for name in ("train", "eval"):
            assert_that(
                outputs[name] | f"Ids{name}" >> __import__("apache_beam").Map(ids_of),
                equal_to(expected[name]),
                label=f"Check{name}",
            )
        assert_that(
            outputs[DROPPED_TAG]
            | "Reasons" >> __import__("apache_beam").Map(lambda d: (d["source_id"], d["reason"])),
            equal_to([(sid, r) for sid, r in bad.items() if r is not None]),
            label="CheckDropped",
        )


# ---------------------------------------------------------------------------- end to end


def _overrides(shapes_dir, encoder_dir, out, **extra) -> list[str]:
    values = {
        "output_dir": out,
        "source": str(shapes_dir),
        "pretrained_model_name_or_path": str(encoder_dir),
        "max_sequence_length": SEQ_LEN,
        "height": HEIGHT,
        "width": WIDTH,
        "eval_fraction": 0.4,
        "records_per_shard": 4,
        "max_bad_fraction": 0.2,
        "runner": "DirectRunner",
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def _read_split(manifest, split_name: str) -> list[dict]:
    import tensorflow as tf

    local = storage.local_copy(manifest.uri)
    files = [str(local / p) for p in manifest.summary["splits"][split_name]["shards"]]
    assert files == sorted(files) and files
    shapes = {name: f["shape"] for name, f in manifest.summary["features"].items()}
    dataset = tf.data.TFRecordDataset(files).map(
        lambda s: records.parse_example(s, shapes, with_timesteps=split_name == "eval")
    )
    return [
        {k: (v.numpy() if hasattr(v, "numpy") else v) for k, v in row.items()}
        for row in dataset.as_numpy_iterator()
    ]


def _check_artifact(uri: str, direct, shapes_dir: Path) -> None:
    from jaxcore.artifacts import open_artifact
    from stages.convert.media import prepare_video

    manifest = open_artifact(uri, "convert")
    s = manifest.summary
    assert s["family"] == "wan"
    assert s["features"] == {
        "latents": {"shape": [4, 1, HEIGHT // 2, WIDTH // 2], "dtype": "float32"},
        "encoder_hidden_states": {"shape": [SEQ_LEN, 32], "dtype": "float32"},
    }
    assert s["latents_normalization"]["latent_sampling"] == "mean"
    assert s["latents_normalization"]["latents_mean"] == pytest.approx(list(LATENTS_MEAN))
    assert s["rows_read"] == 14 and s["dropped_total"] == 2
    assert s["dropped"][media.UNDECODABLE_MEDIA] == 1 and s["dropped"][media.EMPTY_CAPTION] == 1
    dropped = storage.read_text(storage.join(uri, s["dropped_file"])).splitlines()
    assert sorted(json.loads(line)["reason"] for line in dropped) == sorted(
        [media.UNDECODABLE_MEDIA, media.EMPTY_CAPTION]
    )
    train, evals = _read_split(manifest, "train"), _read_split(manifest, "eval")
    assert (
        len(train) == s["splits"]["train"]["records"]
        and len(evals) == s["splits"]["eval"]["records"]
    )
    assert len(train) + len(evals) == 12
    train_ids = {r[records.SOURCE_ID].decode() for r in train}
    eval_ids = {r[records.SOURCE_ID].decode() for r in evals}
    assert not train_ids & eval_ids and len(train_ids) == len(train)
    assert all(split.assign_split(i, 0.4, 0) == "eval" for i in eval_ids)
    # Shards hold at most records_per_shard records (planned from the source count).
    assert len(s["splits"]["train"]["shards"]) == -(-sum(split.assign_split(
        f"shape-3-{i:05d}", 0.4, 0) == "train" for i in range(14)) // 4)  # fmt: skip
    # Eval buckets: every record's timestep is listed, sizes differ by at most one.
    bucket = split.bucket_counts([int(r[records.TIMESTEPS]) for r in evals], s["timesteps_list"])
    assert bucket == s["eval_timestep_counts"]
    assert max(bucket.values()) - min(bucket.values()) <= 1
    # Record contents equal the direct jaxcore encodings of the same source item.
    latents_fn, text_fn = direct
    items = {
        i["id"]: i for i in synthetic.make_items(14, 24, 20, seed=3, corrupt=1, empty_captions=1)
    }
    for row in train[:2] + evals[:2]:
        item = items[row[records.SOURCE_ID].decode()]
        assert row[records.LATENTS].dtype == np.float32
        video = prepare_video(item["image_bytes"], height=HEIGHT, width=WIDTH, num_frames=1, fps=16)
        np.testing.assert_allclose(row[records.LATENTS], latents_fn(video), atol=ATOL)
        np.testing.assert_allclose(row["encoder_hidden_states"], text_fn(item["text"]), atol=ATOL)
        assert row[records.CAPTION].decode() == item["text"]
    # The empty caption, encoded by the same text encoder (what caption dropout swaps in).
    assert s["empty_prompt"] == {"file": records.EMPTY_PROMPT_FILE, "features": [TEXT]}
    empty = records.load_empty_prompt(storage.read_bytes(manifest.path(records.EMPTY_PROMPT_FILE)))
    np.testing.assert_allclose(empty[TEXT], text_fn(""), atol=ATOL)
    assert np.abs(empty[TEXT]).max() > 0  # "" still encodes its end-of-sequence token


def test_cli_end_to_end_local(tmp_path, shapes_dir, encoder_dir, direct, capsys, monkeypatch):
    from apache_beam.runners.portability import prism_runner
    from apache_beam.runners.portability.fn_api_runner import fn_runner

    # runner=DirectRunner runs in Beam's FnApiRunner, and never tries Prism (a binary Beam's
    # own DirectRunner would download at run time; it swallows the attempt's errors)
    engines = []
    prism_run, fnapi_run = prism_runner.PrismRunner.run_pipeline, fn_runner.FnApiRunner.run_pipeline
    monkeypatch.setattr(
        prism_runner.PrismRunner,
        "run_pipeline",
        lambda *a, **k: engines.append("prism") or prism_run(*a, **k),
    )
    monkeypatch.setattr(
        fn_runner.FnApiRunner,
        "run_pipeline",
        lambda *a, **k: engines.append("fnapi") or fnapi_run(*a, **k),
    )
    out = str(tmp_path / "converted")
    assert main(["convert", CONFIG, *_overrides(shapes_dir, encoder_dir, out)]) == 0
    assert engines == ["fnapi"]
    assert "artifact" in capsys.readouterr().out
    _check_artifact(out, direct, shapes_dir)
    before = (Path(out) / "manifest.json").read_bytes()
    # Same config again: the finished artifact is found and nothing is redone.
    assert main(["convert", CONFIG, *_overrides(shapes_dir, encoder_dir, out)]) == 0
    assert (Path(out) / "manifest.json").read_bytes() == before


def test_cli_end_to_end_gcs(gcs_root, shapes_dir, encoder_dir, direct):
    assert main(["convert", CONFIG, *_overrides(shapes_dir, encoder_dir, gcs_root)]) == 0
    _check_artifact(gcs_root, direct, shapes_dir)


def test_too_many_bad_rows_fail_without_manifest(tmp_path, shapes_dir, encoder_dir, capsys):
    out = str(tmp_path / "converted")
    args = _overrides(shapes_dir, encoder_dir, out, max_bad_fraction=0.1)
    assert main(["convert", CONFIG, *args]) == 2
    err = capsys.readouterr().err
    assert "2 of 14 rows" in err and "max_bad_fraction=0.1" in err
    assert "undecodable_media=1" in err and "empty_caption=1" in err
    assert not (Path(out) / "manifest.json").exists()


def test_killed_run_leaves_no_manifest_and_rerun_completes(
    tmp_path, shapes_dir, encoder_dir, direct, monkeypatch
):
    from stages.convert import run as run_module

    out = tmp_path / "converted"
    stale = out / "train/train-00000-of-00009.tfrecord"  # a shard of some older, killed run
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"stale")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies after the shards are written

    monkeypatch.setattr(run_module, "_summary", killed)
    assert main(["convert", CONFIG, *_overrides(shapes_dir, encoder_dir, str(out))]) == 130
    assert not (out / "manifest.json").exists()
    written = set((out / "train").glob("train-*.tfrecord")) - {stale}
    assert written  # the job wrote its shards before it was killed
    monkeypatch.undo()
    assert main(["convert", CONFIG, *_overrides(shapes_dir, encoder_dir, str(out))]) == 0
    assert not stale.exists()
    _check_artifact(str(out), direct, shapes_dir)


def test_a_plain_imagefolder_converts_with_media_path_ids(tmp_path, encoder_dir):
    """No id column (an imagefolder as users have one): ids are the images' paths in the
    folder, recorded in the manifest as such."""
    from jaxcore.artifacts import open_artifact
    from tests.stages.test_convert_elements import _plain_imagefolder

    folder = _plain_imagefolder(tmp_path / "imgs", [f"img{i}.png" for i in range(6)])
    out = tmp_path / "converted"
    args = _overrides(folder, encoder_dir, str(out), eval_fraction=0.0)
    assert main(["convert", CONFIG, *args]) == 0
    manifest = open_artifact(str(out), "convert")
    assert manifest.summary["source"]["id_source"] == "media_path"
    rows = _read_split(manifest, "train")
    assert sorted(r[records.SOURCE_ID].decode() for r in rows) == [f"img{i}.png" for i in range(6)]


def test_rows_are_reshuffled_only_where_there_are_workers_to_spread_them_over():
    from stages.convert.config import BeamConfig
    from stages.convert.pipeline import needs_spreading

    assert not needs_spreading(BeamConfig())  # DirectRunner, one worker, in memory
    assert needs_spreading(BeamConfig(direct_num_workers=2, direct_running_mode="multi_processing"))
    assert needs_spreading(BeamConfig(runner="FlinkRunner"))


def test_only_the_direct_runner_is_replaced_by_a_runner_object():
    from apache_beam.runners.portability.fn_api_runner import fn_runner

    from stages.convert.config import BeamConfig
    from stages.convert.pipeline import local_runner, pipeline_options

    direct = BeamConfig(direct_num_workers=2, direct_running_mode="multi_processing")
    runner = local_runner(direct, pipeline_options(direct, "job"))
    assert isinstance(runner, fn_runner.FnApiRunner)
    flink = BeamConfig(runner="FlinkRunner")
    assert local_runner(flink, pipeline_options(flink, "job")) is None


def test_two_runs_write_byte_identical_shards(tmp_path, shapes_dir, encoder_dir):
    """Shards are contiguous runs of a hash order of the ids, records serialised
    deterministically: the same source and config give the same bytes, whatever order the
    runner processed them in (so two trainings on two conversions are the same training):
    here one worker thread with one encoder thread (rows not reshuffled) vs the DirectRunner's
    multi-process mode (2 worker processes, rows reshuffled, each with 2 encoder threads)."""
    outs = [tmp_path / "a", tmp_path / "b"]
    modes = [
        {"encode_threads": 1},
        {"direct_num_workers": 2, "direct_running_mode": "multi_processing"},
    ]
    for out, mode in zip(outs, modes, strict=True):
        args = _overrides(shapes_dir, encoder_dir, str(out), **mode)
        assert main(["convert", CONFIG, *args]) == 0
    files = sorted(p.relative_to(outs[0]).as_posix() for p in outs[0].rglob("*.tfrecord"))
    assert files and files == sorted(
        p.relative_to(outs[1]).as_posix() for p in outs[1].rglob("*.tfrecord")
    )
    for rel in files:
        assert (outs[0] / rel).read_bytes() == (outs[1] / rel).read_bytes(), rel


def test_sigterm_stops_the_job_exits_75_and_a_rerun_completes(
    tmp_path, shapes_dir, encoder_dir, direct, monkeypatch
):
    """Preemption mid-job: no manifest, exit 75 (EXIT_PREEMPTED); the rerun converts all."""
    import os
    import signal

    from stages.common.preemption import EXIT_PREEMPTED

    calls = []
    original = media.prepare_video

    def preempted_midway(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the job is running: the pod is told to stop
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(media, "prepare_video", preempted_midway)
    out = tmp_path / "converted"
    assert main(["convert", CONFIG, *_overrides(shapes_dir, encoder_dir, str(out))]) == (
        EXIT_PREEMPTED
    )
    assert len(calls) >= 3 and not (out / "manifest.json").exists()
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handler is gone
    assert main(["convert", CONFIG, *_overrides(shapes_dir, encoder_dir, str(out))]) == 0
    _check_artifact(str(out), direct, shapes_dir)


def test_dataflow_dry_run_stages_the_package(tmp_path, gcs_root, shapes_dir, encoder_dir, caplog):
    """DataflowRunner with dry_run builds the job, with setup.py's package as a staged
    artifact (``workflow.tar.gz``), and submits nothing."""
    import logging

    caplog.set_level(logging.INFO, logger="stages.convert.run")
    out = str(tmp_path / "converted")
    args = _overrides(
        shapes_dir,
        encoder_dir,
        out,
        runner="DataflowRunner",
        project="local-project",
        region="us-central1",
        temp_location=f"{gcs_root}/tmp",
        staging_location=f"{gcs_root}/staging",
        setup_file=str(REPO / "setup.py"),
        machine_type="n1-standard-4",
        max_num_workers=2,
        worker_accelerator="type:nvidia-l4;count:1;install-nvidia-driver",
        dry_run="true",
    )
    assert main(["convert", CONFIG, *args]) == 0
    assert not (Path(out) / "manifest.json").exists()
    assert "workflow.tar.gz" in caplog.text and "nothing was submitted" in caplog.text
