"""The record format shared by convert (writer) and train/evaluate (readers).

One ``tf.train.Example`` per item, as MaxDiffusion writes Wan TFRecords, plus shapes and ids:

| feature | type | content |
|---|---|---|
| ``latents`` | bytes | ``tf.io.serialize_tensor`` of float32 [C, F, H, W], *normalised* latents ((z - mean) / std) |
| ``encoder_hidden_states`` | bytes | ``tf.io.serialize_tensor`` of float32 [L, D], zero-padded after the prompt |
| ``latents_shape`` | int64 x4 | [C, F, H, W] |
| ``encoder_hidden_states_shape`` | int64 x2 | [L, D] |
| ``caption`` | bytes | UTF-8 caption |
| ``source_id`` | bytes | stable id of the source row |
| ``timesteps`` | int64 | eval split only: the fixed timestep (0..1000) this record is scored at |

Shards: ``<split>/<split>-NNNNN-of-MMMMM.tfrecord`` inside the convert artifact. The convert
manifest's summary describes them for readers::

    splits: {train: {records: N, shards: [paths]}, eval: {records: M, shards: [paths]}}
    latent_shape: [C, F, H, W]
    text_shape: [L, D]
    timesteps_list: [125, ...]
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

LATENTS = "latents"
TEXT = "encoder_hidden_states"
LATENTS_SHAPE = "latents_shape"
TEXT_SHAPE = "encoder_hidden_states_shape"
CAPTION = "caption"
SOURCE_ID = "source_id"
TIMESTEPS = "timesteps"

SPLITS = ("train", "eval")
DEFAULT_TIMESTEPS_LIST = (125, 250, 375, 500, 625, 750, 875)


def _serialize(array: np.ndarray) -> bytes:
    import tensorflow as tf

    return tf.io.serialize_tensor(tf.constant(np.asarray(array, np.float32))).numpy()


def make_example(
    latents: np.ndarray,
    text_embeddings: np.ndarray,
    caption: str,
    source_id: str,
    timestep: int | None = None,
) -> bytes:
    """Serialise one record (see the module docstring for the layout)."""
    import tensorflow as tf

    def b(v: bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

    def i(vs):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x) for x in vs]))

    feats = {
        LATENTS: b(_serialize(latents)),
        TEXT: b(_serialize(text_embeddings)),
        LATENTS_SHAPE: i(np.shape(latents)),
        TEXT_SHAPE: i(np.shape(text_embeddings)),
        CAPTION: b(caption.encode("utf-8")),
        SOURCE_ID: b(source_id.encode("utf-8")),
    }
    if timestep is not None:
        feats[TIMESTEPS] = i([timestep])
    return tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString()


def feature_spec(with_timesteps: bool):
    import tensorflow as tf

    spec = {
        LATENTS: tf.io.FixedLenFeature([], tf.string),
        TEXT: tf.io.FixedLenFeature([], tf.string),
        LATENTS_SHAPE: tf.io.FixedLenFeature([4], tf.int64),
        TEXT_SHAPE: tf.io.FixedLenFeature([2], tf.int64),
        CAPTION: tf.io.FixedLenFeature([], tf.string),
        SOURCE_ID: tf.io.FixedLenFeature([], tf.string),
    }
    if with_timesteps:
        spec[TIMESTEPS] = tf.io.FixedLenFeature([], tf.int64)
    return spec


def parse_example(serialized, latent_shape, text_shape, with_timesteps: bool = False) -> Mapping:
    """tf.data map function: bytes -> dict of tensors with static shapes.

    ``latent_shape`` [C, F, H, W] and ``text_shape`` [L, D] come from the artifact's manifest;
    a record of another shape fails with an error naming the feature and both shapes.
    """
    import tensorflow as tf

    parsed = tf.io.parse_single_example(serialized, feature_spec(with_timesteps))
    latents = tf.io.parse_tensor(parsed[LATENTS], tf.float32)
    text = tf.io.parse_tensor(parsed[TEXT], tf.float32)
    checks = [
        tf.debugging.assert_equal(
            tf.shape(latents, out_type=tf.int64),
            tf.constant(list(latent_shape), tf.int64),
            message=f"record {LATENTS} shape differs from the manifest's {list(latent_shape)}",
        ),
        tf.debugging.assert_equal(
            tf.shape(text, out_type=tf.int64),
            tf.constant(list(text_shape), tf.int64),
            message=f"record {TEXT} shape differs from the manifest's {list(text_shape)}",
        ),
    ]
    with tf.control_dependencies(checks):
        out = {
            LATENTS: tf.ensure_shape(latents, latent_shape),
            TEXT: tf.ensure_shape(text, text_shape),
            CAPTION: parsed[CAPTION],
            SOURCE_ID: parsed[SOURCE_ID],
        }
    if with_timesteps:
        out[TIMESTEPS] = parsed[TIMESTEPS]
    return out


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}/{split}-{index:05d}-of-{count:05d}.tfrecord"
