"""Builders of tiny convert artifacts for tests (train, evaluate, generate, pipelines).

The summary keys match what the convert stage writes: ``family``, ``features: {latents:
{shape, dtype}, encoder_hidden_states: {...}}``, ``splits: {train: {records, shards}, eval:
{...}}``, ``timesteps_list`` (Wan-family records: latents [C, F, H, W], text [L, D]).
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
from stages.common import records

TEXT = "encoder_hidden_states"


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
    family: str = "wan"
    # conditioning tensors besides the text (name, shape), e.g. Flux's pooled_projections
    extra_features: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # write empty_prompt.safetensors (a fixed random row per conditioning tensor), as convert does
    empty_prompt: bool = False

    @property
    def conditioning(self) -> dict[str, tuple[int, ...]]:
        return {TEXT: tuple(self.text_shape), **{n: tuple(s) for n, s in self.extra_features}}


# Flux-family records of the tiny Flux (configs/models/flux_tiny.yml, tests/support/tiny_flux.py).
FLUX = dict(
    family="flux",
    latent_shape=(4, 8, 8),
    text_shape=(8, 32),
    extra_features=(("pooled_projections", (24,)),),
)


def _examples(cfg: TinyDataConfig, split: str, count: int) -> list[bytes]:
    rng = np.random.default_rng(cfg.seed)
    patterns = rng.standard_normal((cfg.num_patterns, *cfg.latent_shape)).astype(np.float32)
    conditioning = {
        name: rng.standard_normal((cfg.num_patterns, *shape)).astype(np.float32)
        for name, shape in cfg.conditioning.items()
    }
    split_rng = np.random.default_rng([cfg.seed, 0 if split == "train" else 1])
    out = []
    for i in range(count):
        k = i % cfg.num_patterns
        latents = patterns[k] + 0.05 * split_rng.standard_normal(cfg.latent_shape)
        timestep = None
        if split == "eval":
            timestep = cfg.timesteps_list[i % len(cfg.timesteps_list)]
        tensors = {records.LATENTS: latents.astype(np.float32)}
        tensors |= {name: values[k] for name, values in conditioning.items()}
        out.append(
            records.make_example(
                tensors, caption=f"pattern {k}", source_id=f"{split}-{i:06d}", timestep=timestep
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
    shapes = {records.LATENTS: tuple(cfg.latent_shape), **cfg.conditioning}
    summary = {
        "family": cfg.family,
        "features": {name: {"shape": list(s), "dtype": "float32"} for name, s in shapes.items()},
        "splits": splits,
        "timesteps_list": list(cfg.timesteps_list),
    }
    if cfg.empty_prompt:
        storage.write_bytes(
            storage.join(uri, records.EMPTY_PROMPT_FILE), records.empty_prompt_bytes(empty_row(cfg))
        )
        summary["empty_prompt"] = {
            "file": records.EMPTY_PROMPT_FILE,
            "features": sorted(cfg.conditioning),
        }
    return ArtifactWriter(uri, "convert", cfg).commit(summary)


def empty_row(cfg: TinyDataConfig) -> dict[str, np.ndarray]:
    """The empty caption's tensors of an artifact with ``empty_prompt`` (fixed, random)."""
    rng = np.random.default_rng([cfg.seed, 2])
    return {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in cfg.conditioning.items()
    }
