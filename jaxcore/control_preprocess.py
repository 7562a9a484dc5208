"""ControlNet conditioning preprocessors: Canny edges, bit-identical to OpenCV.

A ControlNet canny model was trained on edge maps made by ``cv2.Canny(image, low, high)``
(diffusers' examples: ``cv2.Canny(np.array(image), 100, 200)`` on the RGB array, stacked to
three channels). Bulk jobs often have only photos, so they need the same edge map built in: an
edge map that differs from the training one by a few pixels along every contour is a different
conditioning signal. This module reproduces OpenCV's ``modules/imgproc/src/canny.cpp`` in numpy
and scipy, so no OpenCV is needed at runtime; the tests compare it with ``cv2.Canny``
bit for bit.

What it reproduces (``cv2.Canny`` semantics, all verified against cv2):

* Sobel derivatives with ``BORDER_REPLICATE`` as int16; aperture 7 scales them by 1/16 (rounded
  half to even, as cv2 does to keep int16 from overflowing) and divides both thresholds by 16.
* Magnitude ``|dx| + |dy|`` (or ``dx**2 + dy**2`` with ``l2_gradient``, thresholds squared).
* Thresholds: swapped when ``low > high``, then ``floor``-ed to integers; comparisons are strict
  (``magnitude > low``, ``magnitude > high``).
* Several channels: each pixel takes dx / dy of the channel with the largest magnitude, the
  first such channel on ties.
* Non-maximum suppression in four sectors split by tan(22.5 deg) in Q15 fixed point; a pixel
  must be strictly above the neighbour before it and at least equal to the one after it
  (horizontal and vertical), strictly above both on diagonals; outside the image counts as 0.
* Hysteresis: local maxima above ``low`` that are 8-connected to a local maximum above ``high``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image
from scipy import ndimage

# canny.cpp's fixed point: tan(22.5 deg) in Q15, the boundary between the sectors.
_CANNY_SHIFT = 15
_TG22 = int(0.4142135623730950488016887242097 * (1 << _CANNY_SHIFT) + 0.5)

# OpenCV's getSobelKernels for a first derivative: (smoothing, derivative), applied as a
# correlation (kernel[i] multiplies src[x + i - radius]).
_SOBEL_KERNELS = {
    3: (np.array([1, 2, 1]), np.array([-1, 0, 1])),
    5: (np.array([1, 4, 6, 4, 1]), np.array([-1, -2, 0, 2, 1])),
    7: (np.array([1, 6, 15, 20, 15, 6, 1]), np.array([-1, -4, -5, 0, 5, 4, 1])),
}
# Aperture 7's sums reach 255 * 64 * 10 = 163200, past int16: cv2 scales the derivatives (and
# the thresholds) by 1/16.
_APERTURE7_SCALE = 16


def canny(
    image: np.ndarray,
    low: float,
    high: float,
    *,
    aperture_size: int = 3,
    l2_gradient: bool = False,
) -> np.ndarray:
    """Canny edges of a uint8 ``[H, W]`` or ``[H, W, C]`` image, equal to ``cv2.Canny``.

    Returns uint8 ``[H, W]`` holding 0 or 255. ``low > high`` is swapped, as cv2 does.
    """
    channels = _as_channels(image)
    if aperture_size not in _SOBEL_KERNELS:
        raise ValueError(f"aperture_size must be 3, 5 or 7 (as cv2.Canny), got {aperture_size!r}")
    low_int, high_int = _integer_thresholds(low, high, aperture_size, l2_gradient)
    dx, dy = _sobel_derivatives(channels, aperture_size)
    magnitude = _magnitude(dx, dy, l2_gradient)
    magnitude, dx, dy = _strongest_channel(magnitude, dx, dy)
    maxima = _non_maximum_suppression(magnitude, dx, dy) & (magnitude > low_int)
    edges = _hysteresis(maxima, maxima & (magnitude > high_int))
    return edges.astype(np.uint8) * np.uint8(255)


def _as_channels(image: np.ndarray) -> np.ndarray:
    """Check the input as cv2 would and view it as ``[H, W, C]``."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        raise ValueError(f"image must be uint8 (as cv2.Canny requires), got {image.dtype}")
    if image.ndim == 2:
        return image[:, :, None]
    if image.ndim == 3 and image.shape[2] in (1, 3):
        return image
    raise ValueError(f"image must be [H, W] or [H, W, 1 or 3], got shape {image.shape}")


def _integer_thresholds(
    low: float, high: float, aperture_size: int, l2_gradient: bool
) -> tuple[int, int]:
    """cv2's thresholds: swapped, scaled for aperture 7, squared for L2, then floored."""
    low, high = float(low), float(high)
    if not (math.isfinite(low) and math.isfinite(high)):
        # cv2 floors NaN / inf to an unspecified int; refuse instead of guessing.
        raise ValueError(f"low and high must be finite, got low={low!r}, high={high!r}")
    if low > high:
        low, high = high, low
    if aperture_size == 7:
        low, high = low / _APERTURE7_SCALE, high / _APERTURE7_SCALE
    if l2_gradient:
        # cv2 clamps to int16's range before squaring and leaves non-positive values alone.
        low, high = min(32767.0, low), min(32767.0, high)
        low = low * low if low > 0 else low
        high = high * high if high > 0 else high
    return math.floor(low), math.floor(high)


def _sobel_derivatives(channels: np.ndarray, aperture_size: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``(dx, dy)`` per channel: cv2.Sobel to CV_16S with BORDER_REPLICATE."""
    smooth, derivative = _SOBEL_KERNELS[aperture_size]
    radius = aperture_size // 2
    padded = np.pad(channels.astype(np.int64), ((radius, radius), (radius, radius), (0, 0)), "edge")
    dx = _correlate_axis(_correlate_axis(padded, derivative, axis=1), smooth, axis=0)
    dy = _correlate_axis(_correlate_axis(padded, smooth, axis=1), derivative, axis=0)
    if aperture_size == 7:
        # Exact in float64 (integers / 16); np.rint rounds half to even like cv2's cvRound.
        dx = np.rint(dx / _APERTURE7_SCALE).astype(np.int64)
        dy = np.rint(dy / _APERTURE7_SCALE).astype(np.int64)
    # Saturation as CV_16S; no aperture reaches it on uint8 input, kept for faithfulness.
    return np.clip(dx, -32768, 32767), np.clip(dy, -32768, 32767)


def _correlate_axis(padded: np.ndarray, kernel: np.ndarray, axis: int) -> np.ndarray:
    """Valid-mode 1-D correlation along ``axis`` (the padded border is consumed)."""
    length = padded.shape[axis] - len(kernel) + 1
    total = np.zeros_like(np.take(padded, np.arange(length), axis=axis))
    for offset, weight in enumerate(kernel):
        if weight:
            total += int(weight) * np.take(padded, np.arange(offset, offset + length), axis=axis)
    return total


def _magnitude(dx: np.ndarray, dy: np.ndarray, l2_gradient: bool) -> np.ndarray:
    """Integer gradient magnitude, as canny.cpp computes it."""
    if l2_gradient:
        return dx * dx + dy * dy
    return np.abs(dx) + np.abs(dy)


def _strongest_channel(
    magnitude: np.ndarray, dx: np.ndarray, dy: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per pixel, the channel with the largest magnitude (cv2 keeps the first on ties)."""
    # np.argmax returns the first maximum, matching cv2's strict `>` scan over channels.
    index = np.argmax(magnitude, axis=2)[:, :, None]
    pick = lambda values: np.take_along_axis(values, index, axis=2)[:, :, 0]  # noqa: E731
    return pick(magnitude), pick(dx), pick(dy)


def _non_maximum_suppression(magnitude: np.ndarray, dx: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """Boolean ``[H, W]``: pixels that are a maximum along their gradient's sector."""
    # cv2 surrounds the magnitude with zeros, so border pixels compare against 0 outside.
    padded = np.pad(magnitude, 1)

    def neighbour(row_shift: int, col_shift: int) -> np.ndarray:
        rows, cols = magnitude.shape
        return padded[1 + row_shift : 1 + row_shift + rows, 1 + col_shift : 1 + col_shift + cols]

    abs_x = np.abs(dx)
    abs_y = np.abs(dy) << _CANNY_SHIFT
    tg22x = abs_x * _TG22
    tg67x = tg22x + (abs_x << (_CANNY_SHIFT + 1))
    horizontal = abs_y < tg22x
    vertical = ~horizontal & (abs_y > tg67x)
    diagonal = ~horizontal & ~vertical
    # Opposite signs of dx and dy: the gradient runs up-right / down-left (rows grow downwards).
    anti = (dx ^ dy) < 0
    m = magnitude
    # Before the pixel strictly, after it or equal: a plateau keeps one pixel, as in cv2.
    horizontal_max = (m > neighbour(0, -1)) & (m >= neighbour(0, 1))
    vertical_max = (m > neighbour(-1, 0)) & (m >= neighbour(1, 0))
    main_diagonal_max = (m > neighbour(-1, -1)) & (m > neighbour(1, 1))
    anti_diagonal_max = (m > neighbour(-1, 1)) & (m > neighbour(1, -1))
    diagonal_max = np.where(anti, anti_diagonal_max, main_diagonal_max)
    return (horizontal & horizontal_max) | (vertical & vertical_max) | (diagonal & diagonal_max)


def _hysteresis(candidates: np.ndarray, strong: np.ndarray) -> np.ndarray:
    """Candidates 8-connected (through candidates) to a strong pixel."""
    labels, count = ndimage.label(candidates, structure=np.ones((3, 3), dtype=bool))
    if count == 0:
        return np.zeros(candidates.shape, dtype=bool)
    keep = np.zeros(count + 1, dtype=bool)
    keep[labels[strong]] = True
    keep[0] = False  # label 0 is the background
    return keep[labels]


_ALLOWED_KEYS = ("kind", "low", "high")
_KINDS = ("canny",)


@dataclass(frozen=True)
class ControlPreprocess:
    """How a bulk job turns a photo into a ControlNet conditioning image.

    ``low`` / ``high`` are cv2.Canny's thresholds (diffusers' examples use 100 / 200). Unlike
    ``canny`` (which swaps them, as cv2 does), a config with ``low > high`` is rejected: in a
    config it is almost always a typo, and swapping silently would hide it.
    """

    kind: str = "canny"
    low: float = 100
    high: float = 200

    def __post_init__(self) -> None:
        _validate(self.kind, self.low, self.high, where=type(self).__name__)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], where: str) -> ControlPreprocess:
        """Build from a config mapping; errors name ``where`` and the offending key."""
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{where}: expected a mapping, got {type(mapping).__name__}")
        unknown = sorted(str(key) for key in mapping if key not in _ALLOWED_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {unknown}; allowed keys are {list(_ALLOWED_KEYS)}"
            )
        values = {key: mapping[key] for key in _ALLOWED_KEYS if key in mapping}
        defaults = cls()
        kind = values.get("kind", defaults.kind)
        low = values.get("low", defaults.low)
        high = values.get("high", defaults.high)
        _validate(kind, low, high, where=where)
        return cls(kind=kind, low=low, high=high)

    def apply(self, image: Image.Image) -> Image.Image:
        """The edge map of ``image`` (converted to RGB) as an RGB image, as diffusers does."""
        rgb = np.asarray(image.convert("RGB"))
        edges = canny(rgb, self.low, self.high)
        return Image.fromarray(np.concatenate([edges[:, :, None]] * 3, axis=2))


def _validate(kind: object, low: object, high: object, where: str) -> None:
    """Raise ValueError naming ``where`` and the key when a field is unusable."""
    if kind not in _KINDS:
        raise ValueError(f"{where}.kind: must be one of {list(_KINDS)}, got {kind!r}")
    for key, value in (("low", low), ("high", high)):
        # bool is an int subclass, but `low: true` in a config is a mistake, not 1.
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            raise ValueError(f"{where}.{key}: must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}.{key}: must be a finite number >= 0, got {value!r}")
    if low > high:
        raise ValueError(
            f"{where}.low: must be <= high ({low!r} > {high!r}); cv2 would swap them silently"
        )
