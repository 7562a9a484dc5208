"""Builders of tiny convert artifacts for tests (train, evaluate, generate, pipelines).

The summary keys match what the convert stage writes: ``splits: {train: {records, shards},
eval: {...}}``, ``latent_shape: [C, F, H, W]``, ``text_shape: [L, D]``, ``timesteps_list``.
Latents are a few fixed random patterns (plus a little noise), each paired with its own text
embedding, so a tiny model can visibly learn them within ~100 steps.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxcore import storage
from jaxcore.artifacts import ArtifactWriter, Manifest
from stages import records


@dataclasses.dataclass(frozen=True)
class TinyDataConfig:
    """What the test artifact was built from (its config, hashed into the artifact key)."""

    train_records: int = 32
    eval_records: int = 14
    latent_shape: tuple[int, ...] = (4, 1, 8, 8)
    text_shape: tuple[int, ...] = (8, 32)
    shards_per_split: int = 2
    timesteps_list: tuple[int, ...] = records.DEFAULT_TIMESTEPS_LIST
    num_patterns: int = 4
    seed: int = 0


def _examples(cfg: TinyDataConfig, split: str, count: int) -> list[bytes]:
    rng = np.random.default_rng(cfg.seed)
    patterns = rng.standard_normal((cfg.num_patterns, *cfg.latent_shape)).astype(np.float32)
    texts = rng.standard_normal((cfg.num_patterns, *cfg.text_shape)).astype(np.float32)
    split_rng = np.random.default_rng([cfg.seed, 0 if split == "train" else 1])
    out = []
    for i in range(count):
        k = i % cfg.num_patterns
        latents = patterns[k] + 0.05 * split_rng.standard_normal(cfg.latent_shape)
        timestep = None
        if split == "eval":
            timestep = cfg.timesteps_list[i % len(cfg.timesteps_list)]
        out.append(
            records.make_example(
                latents.astype(np.float32),
                texts[k],
                caption=f"pattern {k}",
                source_id=f"{split}-{i:06d}",
                timestep=timestep,
            )
        )
    return out


def write_shards(directory: str, split: str, examples: Sequence[bytes], shards: int) -> list[str]:
    """Write ``examples`` round-robin into ``shards`` TFRecord files; returns relative paths."""
    import tensorflow as tf

    paths = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in range(shards):
            rel = records.shard_name(split, s, shards)
            local = Path(tmp) / rel
            local.parent.mkdir(parents=True, exist_ok=True)
            with tf.io.TFRecordWriter(str(local)) as writer:
                for ex in examples[s::shards]:
                    writer.write(ex)
            storage.upload_file(local, storage.join(directory, rel))
            paths.append(rel)
    return paths


def write_convert_artifact(uri: str, cfg: TinyDataConfig | None = None) -> Manifest:
    """A finished (manifest-committed) convert artifact of tiny random records at ``uri``."""
    cfg = cfg or TinyDataConfig()
    splits = {}
    for split, count in (("train", cfg.train_records), ("eval", cfg.eval_records)):
        shards = write_shards(uri, split, _examples(cfg, split, count), cfg.shards_per_split)
        splits[split] = {"records": count, "shards": shards}
    summary = {
        "splits": splits,
        "latent_shape": list(cfg.latent_shape),
        "text_shape": list(cfg.text_shape),
        "timesteps_list": list(cfg.timesteps_list),
    }
    return ArtifactWriter(uri, "convert", cfg).commit(summary)
