"""How far a cached render is from the dense one: PSNR, SSIM and a side-by-side grid.

PSNR on [0, 1] frames (all frames and channels). SSIM as Wang et al. (2004) define it and
scikit-image's ``structural_similarity(..., gaussian_weights=True, sigma=1.5,
use_sample_covariance=False, data_range=1, channel_axis=-1)`` computes it (the MagCache /
TeaCache papers' setting): Gaussian-weighted local statistics (sigma 1.5, truncated at 3.5
sigma), K1 = 0.01, K2 = 0.03, the map averaged over pixels away from the border, per channel,
then over channels and frames. The tests check both against scikit-image.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

K1, K2, SIGMA, TRUNCATE = 0.01, 0.03, 1.5, 3.5


def psnr(reference: np.ndarray, test: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB of ``test`` against ``reference`` ([0, 1] values);
    ``inf`` when they are equal."""
    mse = float(np.mean((np.asarray(reference, np.float64) - np.asarray(test, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10.0 * np.log10(1.0 / mse)


def _ssim_channel(x: np.ndarray, y: np.ndarray) -> float:
    from scipy.ndimage import gaussian_filter

    def blur(image):
        return gaussian_filter(image, SIGMA, mode="reflect", truncate=TRUNCATE)

    mx, my = blur(x), blur(y)
    vx, vy = blur(x * x) - mx * mx, blur(y * y) - my * my
    cov = blur(x * y) - mx * my
    c1, c2 = K1**2, K2**2
    ssim_map = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2))
    pad = int(TRUNCATE * SIGMA + 0.5)  # the window's radius: the border is left out
    inner = ssim_map[pad:-pad, pad:-pad] if min(x.shape) > 2 * pad else ssim_map
    return float(inner.mean())


def ssim(reference: np.ndarray, test: np.ndarray) -> float:
    """Mean SSIM of ``test`` against ``reference``: ``[F, H, W, C]`` or ``[H, W, C]`` in
    [0, 1]."""
    a, b = np.asarray(reference, np.float64), np.asarray(test, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"ssim: shapes differ, {a.shape} vs {b.shape}")
    if a.ndim == 3:
        a, b = a[None], b[None]
    values = [
        _ssim_channel(a[f, ..., c], b[f, ..., c])
        for f in range(a.shape[0])
        for c in range(a.shape[-1])
    ]
    return float(np.mean(values))


def comparison_grid(rows: Sequence[tuple[np.ndarray, np.ndarray]], size: int = 160) -> bytes:
    """A PNG with one row per prompt: dense, cached, and their difference x4 (first frame).

    ``rows``: ``(dense, cached)`` frames ``[H, W, 3]`` in [0, 1]."""
    from PIL import Image

    from jaxcore.sampling import to_uint8

    gap = 4
    tiles = []
    for dense, cached in rows:
        diff = np.clip(np.abs(np.asarray(dense) - np.asarray(cached)) * 4.0, 0.0, 1.0)
        images = [Image.fromarray(to_uint8(x)) for x in (dense, cached, diff)]
        tiles.append(
            [im.resize((size, size * im.height // im.width), Image.NEAREST) for im in images]
        )
    height = max((t[0].height for t in tiles), default=size)
    sheet = Image.new("RGB", (3 * size + 2 * gap, max(1, len(tiles)) * (height + gap)), "black")
    for r, row in enumerate(tiles):
        for c, tile in enumerate(row):
            sheet.paste(tile, (c * (size + gap), r * (height + gap)))
    out = io.BytesIO()
    sheet.save(out, format="PNG")
    return out.getvalue()
