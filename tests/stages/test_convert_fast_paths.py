"""Convert's fast paths produce what the slow ones did: records serialised without TensorFlow
(the bytes of ``records.make_example`` and ``tf.io.TFRecordWriter``), a folder's split inference
answered without globbing (the same dataset and fingerprint), the driver's dataset reused in
process, full encode batches, and a default job that never imports TensorFlow or
``apache_beam.ml`` (torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stages.common import records
from stages.convert import source, tfrecord
from stages.convert.config import DatasetConfig

REPO = Path(__file__).resolve().parents[2]

SHAPES = [
    {"latents": (4, 1, 16, 16), "encoder_hidden_states": (16, 32)},
    {"latents": (16,), "pooled": ()},  # a scalar: an empty shape
    {"latents": (0, 3), "x": (2, 0, 1)},  # empty tensors
    {"latents": (3, 2), "latents_mask": (2,), "text_ids": (7, 3)},  # prefix-sharing names
    {"latents": (16, 1, 32, 32)},  # lengths past the table of small varints (2**14)
]


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize(
    "caption,sid,timestep",
    [("a red circle", "cat/001.png", None), ("ünï ✓", "x", 875), ("c", "s", 0), ("c", "s", 2**40)],
)
def test_example_bytes_equal_make_example(shapes, caption, sid, timestep):
    rng = np.random.default_rng(0)
    tensors = {
        name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()
    }
    expected = records.make_example(tensors, caption, sid, timestep)
    assert tfrecord.example_bytes(tensors, caption, sid, timestep) == expected


def test_example_bytes_cast_to_float32_and_refuse_reserved_names():
    array = np.arange(12, dtype=np.float64).reshape(3, 4).T  # float64, not C-contiguous
    assert tfrecord.example_bytes({"latents": array}, "c", "s") == records.make_example(
        {"latents": array}, "c", "s"
    )
    with pytest.raises(ValueError, match="clash"):
        tfrecord.example_bytes({"caption": np.zeros(2)}, "c", "s")


def test_tfrecord_files_equal_tensorflows_and_read_back(tmp_path):
    import tensorflow as tf

    rng = np.random.default_rng(1)
    shapes = {"latents": (4, 1, 2, 2), "encoder_hidden_states": (3, 5)}
    examples = [
        records.make_example(
            {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()},
            f"caption {i}",
            f"id{i}",
            125 if i % 2 else None,
        )
        for i in range(5)
    ]
    with tf.io.TFRecordWriter(str(tmp_path / "tf.tfrecord")) as writer:
        for example in examples:
            writer.write(example)
    with tfrecord.TFRecordWriter(str(tmp_path / "ours.tfrecord")) as writer:
        for example in examples:
            writer.write(example)
    assert (tmp_path / "ours.tfrecord").read_bytes() == (tmp_path / "tf.tfrecord").read_bytes()
    read = list(tf.data.TFRecordDataset(str(tmp_path / "ours.tfrecord")).as_numpy_iterator())
    assert read == examples


def test_a_folder_with_split_folders_still_gets_its_splits(tmp_path):
    from PIL import Image

    for split_name in ("train", "test"):
        (tmp_path / split_name).mkdir()
        Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / split_name / "a.png")
    (tmp_path / "train" / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "red"}\n')
    (tmp_path / "test" / "metadata.jsonl").write_text('{"file_name": "a.png", "text": "red"}\n')
    test = source.load_source(DatasetConfig(source=str(tmp_path), dataset_split="test"))
    assert len(test) == 1


def test_kept_dataset_is_found_in_process_only_until_released():
    token = source.keep(["a dataset"])
    assert source.kept(token) == ["a dataset"]
    assert source.kept(None) is None and source.kept("unknown") is None
    source.release(token)
    assert source.kept(token) is None


class _Model:
    """Encoders that record their batch sizes (the real ones pad to batch_size)."""

    def __init__(self):
        self.text_batches = []

    def encode_media(self, videos):
        return np.asarray(videos)[:, :1] * 2

    def encode_media_conditioning(self, videos):
        return {}

    def encode_text(self, captions):
        self.text_batches.append(len(captions))
        return {"encoder_hidden_states": np.array([[[len(c)]] for c in captions], np.float32)}


def test_encode_batches_pads_captions_and_counts_batches():
    from jaxcore.compute import ComputeConfig
    from stages.convert.config import EncoderConfig
    from stages.convert.encode import EncoderHandler
    from stages.convert.pipeline import EncodeBatches

    handler = EncoderHandler(
        EncoderConfig(pretrained_model_name_or_path="x", batch_size=4), ComputeConfig()
    )
    assert handler.batch_elements_kwargs() == {"min_batch_size": 4, "max_batch_size": 4}
    dofn = EncodeBatches(handler)
    dofn._model = model = _Model()
    dofn.start_bundle()
    batch = [
        {"source_id": f"s{i}", "caption": "ab" * (i + 1), "video": np.ones((3, 1, 2, 2))}
        for i in range(3)
    ]
    out = list(dofn.process(batch)) + [wv.value for wv in dofn.finish_bundle()]
    dofn.teardown()
    assert model.text_batches == [4]  # a full batch of captions: no new program per size
    assert [o["source_id"] for o in out] == ["s0", "s1", "s2"]
    assert [float(o["tensors"]["encoder_hidden_states"][0, 0]) for o in out] == [2, 4, 6]


@pytest.mark.parametrize("encode_threads", [None, 1, 3])
def test_encode_batches_encode_on_their_own_thread_a_few_batches_behind(encode_threads):
    """process() queues a batch for the encoder threads and returns those more than
    ENCODE_AHEAD (or the thread count) behind; finish_bundle() the rest, in order, in the
    global window. By default two threads on the CPU."""
    import threading

    from apache_beam.transforms.window import GlobalWindow

    from jaxcore.compute import ComputeConfig
    from stages.convert import pipeline
    from stages.convert.config import EncoderConfig
    from stages.convert.encode import EncoderHandler

    threads = []

    class Model(_Model):
        def encode_media(self, videos):
            threads.append(threading.get_ident())
            return super().encode_media(videos)

    config = EncoderConfig(
        pretrained_model_name_or_path="x", batch_size=2, encode_threads=encode_threads
    )
    handler = EncoderHandler(config, ComputeConfig())
    threads_wanted = encode_threads or 2  # jax computes on the CPU here
    assert handler.encode_threads() == threads_wanted
    ahead = max(pipeline.ENCODE_AHEAD, threads_wanted)
    dofn = pipeline.EncodeBatches(handler)
    dofn._model = Model()
    batches = [
        [{"source_id": f"b{b}i{i}", "caption": "c", "video": np.ones((3, 1, 2, 2))} for i in (0, 1)]
        for b in range(ahead + 5)
    ]
    for _ in range(2):  # two bundles on one DoFn instance
        dofn.start_bundle()
        returned = [[o["source_id"] for o in dofn.process(batch)] for batch in batches]
        assert returned[:ahead] == [[]] * ahead and all(returned[ahead:])
        rest = list(dofn.finish_bundle())
        assert all(wv.windows == (GlobalWindow(),) for wv in rest)
        ids = [sid for r in returned for sid in r] + [wv.value["source_id"] for wv in rest]
        assert ids == [item["source_id"] for batch in batches for item in batch]
    dofn.teardown()
    assert threads and threading.get_ident() not in threads
    assert len(set(threads)) <= threads_wanted


def test_encode_threads_must_be_positive():
    from stages.convert.config import EncoderConfig

    with pytest.raises(ValueError, match="encode_threads must be >= 1"):
        EncoderConfig(pretrained_model_name_or_path="x", encode_threads=0)


def test_an_encoder_error_fails_the_bundle():
    from jaxcore.compute import ComputeConfig
    from stages.convert.config import EncoderConfig
    from stages.convert.encode import EncoderHandler
    from stages.convert.pipeline import EncodeBatches

    class Broken(_Model):
        def encode_media(self, videos):
            raise RuntimeError("out of memory in the VAE")

    handler = EncoderHandler(
        EncoderConfig(pretrained_model_name_or_path="x", batch_size=2), ComputeConfig()
    )
    dofn = EncodeBatches(handler)
    dofn._model = Broken()
    dofn.start_bundle()
    list(dofn.process([{"source_id": "a", "caption": "c", "video": np.ones((3, 1, 2, 2))}]))
    with pytest.raises(RuntimeError, match="out of memory in the VAE"):
        list(dofn.finish_bundle())
    dofn.teardown()


def test_the_empty_prompt_is_the_text_encoders_row_of_the_empty_caption():
    from jaxcore.compute import ComputeConfig
    from stages.convert.config import EncoderConfig
    from stages.convert.encode import EncoderHandler

    handler = EncoderHandler(
        EncoderConfig(pretrained_model_name_or_path="x", batch_size=3), ComputeConfig()
    )
    model = _Model()
    item = handler.encode_empty_prompt(model)
    assert model.text_batches == [3]  # a full batch: the program the captions use
    assert item["source_id"] == records.EMPTY_PROMPT_ID and item["caption"] == ""
    assert set(item["tensors"]) == {"encoder_hidden_states"}  # no latents
    assert float(item["tensors"]["encoder_hidden_states"][0, 0]) == 0.0


def test_large_model_encodes_through_run_inference():
    from jaxcore.compute import ComputeConfig
    from stages.convert.config import EncoderConfig
    from stages.convert.encode import EncoderHandler
    from stages.convert.model_handler import EncoderModelHandler

    config = EncoderConfig(pretrained_model_name_or_path="x", batch_size=2, large_model=True)
    handler = EncoderModelHandler(EncoderHandler(config, ComputeConfig()))
    assert handler.share_model_across_processes()
    assert handler.batch_elements_kwargs() == {"min_batch_size": 2, "max_batch_size": 2}
    batch = [{"source_id": "a", "caption": "c", "video": np.ones((3, 1, 2, 2))}]
    (item,) = handler.run_inference(batch, _Model())
    assert item["source_id"] == "a" and set(item["tensors"]) == {"latents", "encoder_hidden_states"}


def test_default_graph_imports_neither_tensorflow_nor_beam_ml(tmp_path):
    """TensorFlow and apache_beam.ml (which imports torch) cost seconds in every process."""
    script = f"""
import sys
import numpy as np
from stages.convert import run, pipeline
from stages.convert.config import SplitConfig
dofn = pipeline.SplitRecords(SplitConfig(eval_fraction=0.0))
tensors = {{"latents": np.ones((4, 1, 2, 2), np.float32)}}
(out,) = dofn.process({{"source_id": "a", "caption": "c", "tensors": tensors}})
writer = pipeline.WriteShard({str(tmp_path)!r}, "train", 1)
list(writer.process((0, [(("k",), out.value[1])])))
bad = [m for m in ("tensorflow", "apache_beam.ml") if m in sys.modules]
assert not bad, bad
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / records.shard_name("train", 0, 1)).stat().st_size > 0
