"""A tiny ``LTX2ImageToVideoPipeline`` folder for tests: the components of
:func:`tests.support.tiny_ltx2.build_ltx2_pipeline`, saved by diffusers as the image-to-video
pipeline (``model_index.json``'s ``_class_name`` is what the ``ltx2`` family reads)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from tests.support import tiny_ltx2


def build_ltx2_i2v_pipeline(
    directory: str | Path, *, seed: int = 0, transformer: dict | None = None
) -> Path:
    """Write a tiny random-init ``LTX2ImageToVideoPipeline`` into ``directory`` (its
    components built by :func:`tiny_ltx2.build_ltx2_pipeline` with ``seed`` / ``transformer``,
    loaded as the image-to-video class and saved with ``save_pretrained``); returns it."""
    import torch
    from diffusers import LTX2ImageToVideoPipeline

    directory = Path(directory)
    staging = directory.parent / f"{directory.name}_t2v"
    tiny_ltx2.build_ltx2_pipeline(staging, seed=seed, transformer=transformer)
    pipe = LTX2ImageToVideoPipeline.from_pretrained(staging, dtype=torch.float32)
    pipe.save_pretrained(directory)
    shutil.rmtree(staging)
    return directory


def conditioning_image(height: int, width: int, seed: int = 0):
    """A smooth RGB test image (PIL) with detail at every scale: gradients plus noise, so both
    the resize and the H.264 re-compression change it."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [x / max(width - 1, 1), y / max(height - 1, 1), 0.5 + 0.5 * np.sin((x + y) / 3.0)], -1
    )
    noisy = np.clip(base + 0.15 * rng.standard_normal(base.shape), 0.0, 1.0)
    return Image.fromarray(np.round(noisy * 255).astype(np.uint8), "RGB")
