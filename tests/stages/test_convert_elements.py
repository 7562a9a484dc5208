"""Convert stage, tier 1: pure per-element functions, config, shard plan, synthetic dataset."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from jaxcore.config import ConfigError, load_config
from jaxcore.families import TensorSpec
from pipelines.embedded import shapes as synthetic
from stages.convert import media, split
from stages.convert.config import ConvertConfig, MediaConfig
from stages.convert.encode import EncoderPlan
from stages.convert.pipeline import plan_shards, row_ranges

REPO = Path(__file__).resolve().parents[2]


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _write_mp4(path: Path, frames: np.ndarray, fps: float) -> None:
    import imageio.v2 as imageio

    imageio.mimwrite(path, list(frames), fps=fps, format="ffmpeg", macro_block_size=1)


# ---------------------------------------------------------------------------- media


def test_image_decodes_as_one_frame_clip():
    image = np.zeros((10, 20, 3), np.uint8)
    image[:, :10] = 255
    clip = media.decode_media(_png(image))
    assert clip.fps is None
    np.testing.assert_array_equal(clip.frames, image[None])


def test_media_bytes_accepts_dataset_cells(tmp_path):
    data = _png(np.zeros((4, 4, 3), np.uint8))
    (tmp_path / "a.png").write_bytes(data)
    assert media.media_bytes({"bytes": data, "path": "x.png"}) == (data, "x.png")
    assert media.media_bytes({"bytes": None, "path": str(tmp_path / "a.png")})[0] == data
    assert media.media_bytes(str(tmp_path / "a.png"))[0] == data
    with pytest.raises(media.DropItem) as err:
        media.media_bytes(None)
    assert err.value.reason == media.MISSING_MEDIA
    with pytest.raises(media.DropItem) as err:
        media.media_bytes(str(tmp_path / "missing.png"))
    assert err.value.reason == media.MISSING_MEDIA and "missing.png" in err.value.detail


def test_corrupt_image_is_undecodable():
    with pytest.raises(media.DropItem) as err:
        media.decode_media(synthetic.CORRUPT_BYTES, "bad.png")
    assert err.value.reason == media.UNDECODABLE_MEDIA


def test_corrupt_video_is_undecodable():
    with pytest.raises(media.DropItem) as err:
        media.decode_media(b"\x00\x00\x00\x18ftypmp42 truncated", "clip.mp4")
    assert err.value.reason == media.UNDECODABLE_MEDIA and "clip.mp4" in err.value.detail


def test_video_decodes_with_frame_rate(tmp_path):
    frames = np.zeros((9, 32, 48, 3), np.uint8)
    for t in range(9):
        frames[t, :, :, 0] = 20 * t  # brightness ramp identifies each frame after lossy coding
    path = tmp_path / "clip.mp4"
    _write_mp4(path, frames, fps=8)
    clip = media.decode_media(path.read_bytes(), "clip.mp4")
    assert clip.fps == pytest.approx(8.0)
    assert clip.frames.shape == (9, 32, 48, 3)
    red = clip.frames[..., 0].mean(axis=(1, 2))
    np.testing.assert_allclose(red, 20 * np.arange(9), atol=6)  # lossy h264: a few levels


def test_prepare_video_samples_resizes_and_scales(tmp_path):
    frames = np.zeros((9, 32, 48, 3), np.uint8)
    for t in range(9):
        frames[t, :, :, 0] = 20 * t
    path = tmp_path / "clip.mp4"
    _write_mp4(path, frames, fps=8)
    video = media.prepare_video(str(path), height=16, width=16, num_frames=5, fps=4)
    assert video.shape == (3, 5, 16, 16) and video.dtype == np.float32
    # 4 fps from an 8 fps clip: source frames 0, 2, 4, 6, 8.
    red = (video[0].mean(axis=(1, 2)) + 1) * 127.5
    np.testing.assert_allclose(red, 20 * np.array([0, 2, 4, 6, 8]), atol=6)
    with pytest.raises(media.DropItem) as err:
        media.prepare_video(str(path), height=16, width=16, num_frames=9, fps=4)
    assert err.value.reason == media.TOO_FEW_FRAMES


def test_sample_frame_indices():
    assert media.sample_frame_indices(30, 30.0, 5, 15.0) == [0, 2, 4, 6, 8]
    assert media.sample_frame_indices(30, 24.0, 3, 24.0) == [0, 1, 2]
    assert media.sample_frame_indices(1, None, 1, 16.0) == [0]
    with pytest.raises(media.DropItem) as err:
        media.sample_frame_indices(1, None, 5, 16.0)  # an image is one frame
    assert err.value.reason == media.TOO_FEW_FRAMES
    with pytest.raises(media.DropItem):
        media.sample_frame_indices(8, 30.0, 5, 15.0)  # needs frame 8


def test_resize_center_crop_keeps_the_centre():
    # A 20x40 image: left quarter red, centre half green, right quarter blue.
    image = np.zeros((1, 20, 40, 3), np.uint8)
    image[0, :, :10, 0] = 255
    image[0, :, 10:30, 1] = 255
    image[0, :, 30:, 2] = 255
    out = media.resize_center_crop(image, 10, 10)
    assert out.shape == (1, 10, 10, 3)
    # Scaled by 0.5 to 10x20, the centre 10 columns are the green half.
    assert out[0, :, 2:8, 1].min() > 200 and out[0, :, 2:8, [0, 2]].max() < 40


def test_resize_center_crop_of_the_target_size_is_the_identity():
    frames = np.random.default_rng(0).integers(0, 256, (2, 6, 5, 3), dtype=np.uint8)
    np.testing.assert_array_equal(media.resize_center_crop(frames, 6, 5), frames)
    assert media.resize_center_crop(frames, 5, 6).shape == (2, 5, 6, 3)  # not the same size


def test_resize_center_crop_upscales_small_media():
    image = np.full((1, 4, 6, 3), 100, np.uint8)
    out = media.resize_center_crop(image, 8, 8)
    assert out.shape == (1, 8, 8, 3)
    np.testing.assert_array_equal(out, 100)


def test_to_model_input_layout_and_range():
    frames = np.array([[[[0, 255, 127]]]], np.uint8)  # [T=1, H=1, W=1, 3]
    video = media.to_model_input(frames)
    assert video.shape == (3, 1, 1, 1)
    np.testing.assert_allclose(video[:, 0, 0, 0], [-1.0, 1.0, 127 / 127.5 - 1], atol=1e-7)


def test_clean_caption():
    assert media.clean_caption("  a red circle \n") == "a red circle"
    for bad in ("", "   ", None):
        with pytest.raises(media.DropItem) as err:
            media.clean_caption(bad)
        assert err.value.reason == media.EMPTY_CAPTION


# ---------------------------------------------------------------------------- split


def test_split_is_deterministic_and_near_the_fraction():
    ids = [f"item-{i}" for i in range(4000)]
    first = [split.assign_split(i, 0.2, seed=3) for i in ids]
    assert first == [split.assign_split(i, 0.2, seed=3) for i in reversed(ids)][::-1]
    fraction = first.count("eval") / len(ids)
    assert 0.17 < fraction < 0.23  # binomial sd ~0.006
    other_seed = [split.assign_split(i, 0.2, seed=4) for i in ids]
    assert other_seed != first
    assert {split.assign_split(i, 0.0) for i in ids} == {"train"}
    assert {split.assign_split(i, 1.0) for i in ids} == {"eval"}


def test_timestep_buckets_are_equal_and_order_free():
    timesteps = (125, 250, 375, 500, 625, 750, 875)
    ids = [f"e{i}" for i in range(23)]
    mapping = split.assign_timesteps(ids, timesteps)
    assert mapping == split.assign_timesteps(list(reversed(ids)), timesteps)
    counts = split.bucket_counts(mapping.values(), timesteps)
    assert sum(counts.values()) == 23
    assert max(counts.values()) - min(counts.values()) <= 1
    assert set(mapping.values()) <= set(timesteps)
    assert split.bucket_counts([], timesteps) == {str(t): 0 for t in timesteps}


# ---------------------------------------------------------------------------- shards, config


def test_plan_shards_by_count_and_by_bytes():
    features = (TensorSpec("latents", (4, 1, 8, 8)), TensorSpec("encoder_hidden_states", (16, 8)))
    shapes = EncoderPlan("wan", Path("."), features, {})
    plan = plan_shards({"train": 25, "eval": 0}, shapes, records_per_shard=10, max_shard_bytes=None)
    assert plan.records_per_shard == 10 and dict(plan.num_shards) == {"train": 3, "eval": 1}
    record = 4 * (4 * 64 + 16 * 8) + 512  # 2048 bytes planned per record
    plan = plan_shards({"train": 25, "eval": 7}, shapes, None, max_shard_bytes=5 * record)
    assert plan.records_per_shard == 5 and dict(plan.num_shards) == {"train": 5, "eval": 2}
    plan = plan_shards({"train": 25, "eval": 7}, shapes, 3, max_shard_bytes=5 * record)
    assert plan.records_per_shard == 3


def test_row_ranges_cover_every_row_once():
    ranges = row_ranges(600, rows_per_read=256)
    assert ranges == [(0, 256), (256, 512), (512, 600)]
    assert row_ranges(0) == []


def test_checked_in_config_loads_with_overrides():
    config = load_config(
        ConvertConfig,
        REPO / "configs/stages/convert.yml",
        ["source=/data/x", "output_dir=gs://b/out", "runner=DirectRunner", "height=48"],
    )
    assert config.dataset.source == "/data/x"
    assert config.output_dir == "gs://b/out"
    assert config.media.height == 48
    assert config.split.timesteps_list == (125, 250, 375, 500, 625, 750, 875)


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("num_frames=0", "num_frames"),
        ("height=0", "height"),
        ("eval_fraction=1.5", "eval_fraction"),
        ("timesteps_list=[100,1200]", "timesteps_list"),
        ("runner=NoSuchRunner", "runner"),
        ("max_bad_fraction=-0.1", "max_bad_fraction"),
        ("records_per_shard=0", "records_per_shard"),
        ("batch_size=0", "batch_size"),
        ("extra_options=[flink_master=x]", "extra_options"),
    ],
)
def test_bad_config_values_name_the_key(override, names):
    with pytest.raises(ConfigError, match=names):
        load_config(ConvertConfig, REPO / "configs/stages/convert.yml", [override])


def test_dataflow_runner_needs_cloud_fields():
    with pytest.raises(ConfigError, match="project, region, temp_location"):
        load_config(ConvertConfig, None, ["output_dir=/tmp/x", "runner=DataflowRunner"])


def test_media_config_leaves_model_sizes_to_the_family():
    # what a model can encode is its family's geometry, checked when convert plans the run
    assert MediaConfig(num_frames=81).num_frames == 81
    assert MediaConfig(height=24, width=40, num_frames=2).num_frames == 2


# ---------------------------------------------------------------------------- synthetic


def test_synthetic_items_are_deterministic_and_captioned():
    a = synthetic.make_items(12, 16, 16, seed=5, corrupt=2, empty_captions=3)
    b = synthetic.make_items(12, 16, 16, seed=5, corrupt=2, empty_captions=3)
    assert a == b
    assert sum(item["image_bytes"] == synthetic.CORRUPT_BYTES for item in a) == 2
    assert sum(item["text"] == "" for item in a) == 3
    for item in a:
        if item["text"]:
            assert item["text"] == synthetic.caption_for(
                item["colour"], item["shape"], item["background"]
            )
            assert item["colour"] != item["background"]
            assert item["shape"] in synthetic.SHAPES and item["colour"] in synthetic.COLOURS
    assert synthetic.make_items(12, 16, 16, seed=6) != synthetic.make_items(12, 16, 16, seed=5)


def test_synthetic_image_shows_its_colours():
    item = synthetic.make_items(1, 32, 32, seed=1)[0]
    clip = media.decode_media(item["image_bytes"])
    pixels = clip.frames[0].reshape(-1, 3)
    colour = np.array(synthetic.COLOURS[item["colour"]])
    background = np.array(synthetic.COLOURS[item["background"]])
    assert (np.abs(pixels - colour).sum(1) == 0).mean() > 0.05  # the shape covers some area
    assert (np.abs(pixels - background).sum(1) == 0).mean() > 0.3


@pytest.mark.parametrize("layout", ["imagefolder", "save_to_disk"])
def test_synthetic_dataset_loads_with_datasets(tmp_path, layout):
    from stages.convert.config import DatasetConfig
    from stages.convert.source import load_source, source_ids

    directory = synthetic.make_shapes_dataset(
        tmp_path / "ds", num_items=6, height=16, width=16, seed=2, corrupt=1, layout=layout
    )
    dataset = load_source(DatasetConfig(source=str(directory)))
    assert len(dataset) == 6
    ids, kind = source_ids(dataset, DatasetConfig(source=str(directory)))
    assert kind == "column:id"
    assert sorted(ids) == [f"shape-2-{i:05d}" for i in range(6)]
    row = dataset[0]
    assert set(row["image"]) == {"bytes", "path"}  # undecoded: the stage decodes and counts
    if layout == "imagefolder":
        lines = (directory / "metadata.jsonl").read_text().splitlines()
        assert json.loads(lines[0])["file_name"].endswith(".png")


def test_source_errors_name_the_column_and_path(tmp_path):
    from stages.common.errors import StageInputError
    from stages.convert.config import DatasetConfig
    from stages.convert.source import load_source

    directory = synthetic.make_shapes_dataset(tmp_path / "ds", num_items=2, height=8, width=8)
    with pytest.raises(StageInputError, match="caption_column='prompt'"):
        load_source(DatasetConfig(source=str(directory), caption_column="prompt"))
    with pytest.raises(StageInputError, match="does not exist"):
        load_source(DatasetConfig(source=str(tmp_path / "nothing_here")))


def test_shards_are_contiguous_runs_of_the_hash_order():
    """Each id has one shard, fixed by the ids of the split alone; shards hold at most
    records_per_shard ids; adding dropped rows never moves others past a boundary."""
    ids = [f"row-{i}" for i in range(23)]
    boundaries = split.shard_boundaries(ids, 5, seed=3)
    assert len(boundaries) == 5
    index = {sid: split.shard_index(split.shard_key(sid, 3), boundaries) for sid in ids}
    sizes = [list(index.values()).count(k) for k in range(5)]
    assert sizes == [5, 5, 5, 5, 3]
    assert split.shard_boundaries(reversed(ids), 5, seed=3) == boundaries  # order-free
    ordered = sorted(ids, key=lambda sid: split.shard_key(sid, 3))
    assert [index[sid] for sid in ordered] == sorted(index.values())  # contiguous runs
    assert split.shard_index((0.0, ""), ()) == 0


# ---------------------------------------------------------------------------- stable ids


def _plain_imagefolder(folder: Path, names: list[str]) -> Path:
    """An imagefolder as a user has one: images and a caption file, no id column."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(names):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (8, 8), (10 * i, 0, 0)).save(folder / name)
        rows.append({"file_name": name, "text": f"caption {i}"})
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_auto_ids_are_media_paths_and_survive_added_rows(tmp_path):
    from stages.convert.config import DatasetConfig
    from stages.convert.source import load_source, source_ids

    folder = _plain_imagefolder(tmp_path / "imgs", ["a.png", "sub/b.png"])
    config = DatasetConfig(source=str(folder))
    ids, kind = source_ids(load_source(config), config)
    assert kind == "media_path" and sorted(ids) == ["a.png", "sub/b.png"]
    _plain_imagefolder(folder, ["a.png", "sub/b.png", "c.png"])  # a row arrives
    more, _ = source_ids(load_source(config), config)
    assert set(ids) < set(more)  # the earlier rows keep their ids


def test_auto_ids_hash_content_without_paths_and_prefer_an_id_column(tmp_path):
    import datasets

    from stages.convert.config import DatasetConfig
    from stages.convert.source import load_source, source_ids

    images = [_png(np.full((4, 4, 3), v, np.uint8)) for v in (1, 2)]
    table = datasets.Dataset.from_dict({"image": images, "text": ["x", "y"]})
    table.save_to_disk(str(tmp_path / "bytes"))
    config = DatasetConfig(source=str(tmp_path / "bytes"))
    ids, kind = source_ids(load_source(config), config)
    assert kind == "content_hash" and all(i.startswith("sha256-") for i in ids)
    assert len(set(ids)) == 2
    again, _ = source_ids(load_source(config), config)
    assert again == ids

    table.add_column("id", ["one", "two"]).save_to_disk(str(tmp_path / "with_id"))
    config = DatasetConfig(source=str(tmp_path / "with_id"))
    assert source_ids(load_source(config), config) == (["one", "two"], "column:id")


def test_new_eval_ids_continue_the_round_robin_of_their_base():
    """An incremental convert deals its eval ids from where the base stopped: the union's
    buckets are as balanced as one convert of every id, and no base id moves."""
    timesteps = (125, 250, 375)
    base_ids = [f"a{i}" for i in range(7)]
    new_ids = [f"b{i}" for i in range(5)]
    base = split.assign_timesteps(base_ids, timesteps)
    new = split.assign_timesteps(new_ids, timesteps, first_bucket=len(base_ids))
    counts = split.bucket_counts([*base.values(), *new.values()], timesteps)
    assert sorted(counts.values()) == [4, 4, 4]
    assert split.assign_timesteps(new_ids, timesteps, first_bucket=0) != new


def test_index_ranges_cover_exactly_the_given_rows():
    from stages.convert.pipeline import index_ranges

    assert index_ranges([5, 1, 2, 3, 9]) == [(1, 4), (5, 6), (9, 10)]
    assert index_ranges(range(7), rows_per_read=3) == [(0, 3), (3, 6), (6, 7)]
    assert index_ranges([]) == []
