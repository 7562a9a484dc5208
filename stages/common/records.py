"""The record format shared by convert (writer) and train/evaluate (readers), for any family.

One ``tf.train.Example`` per item, as MaxDiffusion writes its TFRecords, with the tensors the
model family names (:meth:`jaxcore.families.Family.record_features`) plus shapes and ids:

| feature | type | content |
|---|---|---|
| ``latents`` | bytes | ``tf.io.serialize_tensor`` of float32 latents, normalised as the family does |
| ``<name>`` | bytes | each conditioning tensor of the family (Wan: ``encoder_hidden_states`` [L, D]) |
| ``<name>_shape`` | int64 list | the shape of each tensor above |
| (edit pairs) | bytes | the family's reference latents (e.g. ``reference_0``), named by its hook |
| ``caption`` | bytes | UTF-8 caption |
| ``source_id`` | bytes | stable id of the source row |
| ``timesteps`` | int64 | eval split only: the fixed timestep (0..1000) this record is scored at |

Shards: ``<split>/<split>-NNNNN-of-MMMMM.tfrecord`` inside the convert artifact. The convert
manifest's summary describes them for readers (family-neutral)::

    family: wan
    features: {latents: {shape: [C, F, H, W], dtype: float32},
               encoder_hidden_states: {shape: [L, D], dtype: float32}}
    splits: {train: {records: N, shards: [paths]}, eval: {records: M, shards: [paths]}}
    timesteps_list: [125, ...]
    empty_prompt: {file: empty_prompt.safetensors, features: [encoder_hidden_states]}

``empty_prompt.safetensors`` holds the conditioning tensors of the empty caption ``""`` from the
same text encoders (one row, no batch axis), what a training run swaps in for a share of the
captions (``proportion_empty_prompts``) so that the model learns the unconditional prediction
classifier-free guidance needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

LATENTS = "latents"
CAPTION = "caption"
SOURCE_ID = "source_id"
TIMESTEPS = "timesteps"
RESERVED = (CAPTION, SOURCE_ID, TIMESTEPS)

SPLITS = ("train", "eval")
EMPTY_PROMPT_FILE = "empty_prompt.safetensors"
# the source id of the one extra item a convert job encodes for the empty caption
EMPTY_PROMPT_ID = "__difforge_empty_prompt__"
DEFAULT_TIMESTEPS_LIST = (125, 250, 375, 500, 625, 750, 875)
# Edit pairs (stages.convert DatasetConfig.reference_image_column): each row's reference (source)
# image is resized / cropped as its image and encoded by the family as its pipelines encode a
# reference image; the records carry those latents under the names of the family's
# ``reference_features`` hook (clean context beside the noised latents: the loss counts only
# the latents, as the family's ``apply`` returns only theirs).
# a ControlNet's conditioning image, [H, W, 3] pixel values 0..255 (whole numbers, held as the
# record's float32 like every tensor), resized / cropped as the row's image; see
# stages.convert DatasetConfig.conditioning_image_column
CONDITIONING_PIXELS = "conditioning_pixels"


def shape_key(name: str) -> str:
    return f"{name}_shape"


def _serialize(array: np.ndarray) -> bytes:
    import tensorflow as tf

    return tf.io.serialize_tensor(tf.constant(np.asarray(array, np.float32))).numpy()


def make_example(
    tensors: Mapping[str, np.ndarray],
    caption: str,
    source_id: str,
    timestep: int | None = None,
) -> bytes:
    """Serialise one record: every named float32 tensor with its shape, plus the ids."""
    import tensorflow as tf

    def b(v: bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

    def i(vs):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(x) for x in vs]))

    clash = sorted(set(tensors) & {*RESERVED, *(shape_key(n) for n in tensors)})
    if clash:
        raise ValueError(f"record tensor names {clash} clash with the record's own fields")
    feats = {}
    for name, array in tensors.items():
        feats[name] = b(_serialize(array))
        feats[shape_key(name)] = i(np.shape(array))
    feats[CAPTION] = b(caption.encode("utf-8"))
    feats[SOURCE_ID] = b(source_id.encode("utf-8"))
    if timestep is not None:
        feats[TIMESTEPS] = i([timestep])
    # deterministic: the feature map in a fixed order, so the same record is the same bytes
    example = tf.train.Example(features=tf.train.Features(feature=feats))
    return example.SerializeToString(deterministic=True)


def feature_spec(shapes: Mapping[str, Sequence[int]], with_timesteps: bool):
    import tensorflow as tf

    spec = {}
    for name, shape in shapes.items():
        spec[name] = tf.io.FixedLenFeature([], tf.string)
        spec[shape_key(name)] = tf.io.FixedLenFeature([len(shape)], tf.int64)
    spec[CAPTION] = tf.io.FixedLenFeature([], tf.string)
    spec[SOURCE_ID] = tf.io.FixedLenFeature([], tf.string)
    if with_timesteps:
        spec[TIMESTEPS] = tf.io.FixedLenFeature([], tf.int64)
    return spec


def parse_example(serialized, shapes: Mapping[str, Sequence[int]], with_timesteps: bool = False):
    """tf.data map function: bytes -> dict of tensors with static shapes.

    ``shapes`` ({name: shape}) come from the artifact's manifest; a record whose tensor has
    another shape fails with an error naming the feature and the manifest's shape.
    """
    import tensorflow as tf

    parsed = tf.io.parse_single_example(serialized, feature_spec(shapes, with_timesteps))
    tensors, checks = {}, []
    for name, shape in shapes.items():
        tensors[name] = tf.io.parse_tensor(parsed[name], tf.float32)
        checks.append(
            tf.debugging.assert_equal(
                tf.shape(tensors[name], out_type=tf.int64),
                tf.constant(list(shape), tf.int64),
                message=f"record {name} shape differs from the manifest's {list(shape)}",
            )
        )
    with tf.control_dependencies(checks):
        out = {name: tf.ensure_shape(t, shapes[name]) for name, t in tensors.items()}
        out[CAPTION] = parsed[CAPTION]
        out[SOURCE_ID] = parsed[SOURCE_ID]
    if with_timesteps:
        out[TIMESTEPS] = parsed[TIMESTEPS]
    return out


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}/{split}-{index:05d}-of-{count:05d}.tfrecord"


def empty_prompt_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
    """The ``empty_prompt.safetensors`` bytes of one row of conditioning tensors (float32)."""
    from safetensors.numpy import save

    return save({name: np.ascontiguousarray(value, np.float32) for name, value in tensors.items()})


def load_empty_prompt(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of ``empty_prompt.safetensors`` bytes."""
    from safetensors.numpy import load

    return dict(load(data))
