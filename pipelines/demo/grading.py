"""Grading a rendered coloured-shapes image on colour, shape and background, one by one.

Three small deterministic classifiers, written for the images :mod:`pipelines.embedded.shapes`
draws (one filled shape of one palette colour on a plain field of another), and size-agnostic:

- background (:func:`classify_background`): each border pixel votes for its nearest palette
  colour (:data:`pipelines.embedded.shapes.COLOURS`, all 8); confidence = the winner's share;
- colour (:func:`classify_colour`): pixels whose nearest palette colour is not the background
  and lies within ``palette_distance`` (anti-aliased edge pixels and noise vote for nothing)
  vote; confidence = the winner's share of the votes; no vote (a blank image) -> ``None``;
- shape (:func:`classify_shape`): a soft mask (each pixel's position on the line from the
  measured background to the measured shape colour), cropped to the bounding box of its
  largest connected component and resampled to 16x16, is compared with one template per shape:
  the mean of such masks over shapes drawn by :func:`pipelines.embedded.shapes.draw_shape` at the
  image's own size and random sizes/positions. Every shape draw_shape makes fills its box the
  same way whatever its size, so the normalised mask is the shape. Label = nearest template
  (mean absolute difference), or ``None`` when even that one is farther than
  ``max_shape_distance`` (a blob is no shape); confidence = second-nearest distance minus
  nearest.

The classifiers' own accuracy on ground truth (:func:`classifier_accuracy`, 32x32, demo palette:
4 colours x 3 shapes x 2 backgrounds, ``n=480, seed=0``), clean / degraded (2x down-and-up
bilinear blur, a global per-channel colour shift of up to +-0.04, gaussian noise sigma 0.05,
on 0..1 pixels; :func:`degrade`):

============  =======  ========
attribute     clean    degraded
============  =======  ========
background    1.000    1.000
colour        1.000    1.000
shape         1.000    1.000
============  =======  ========

(``n=960`` on seeds 1, 2, 3: shape 0.999-1.000 degraded, everything else 1.000. Over all 8
colours and all 5 shapes, which the demo does not use: 1.000 clean, shape 0.982 degraded,
mostly cross -> diamond.) ``demo_check.json`` carries the figures measured in each run.

``tests/pipelines/test_demo_grading.py`` asserts >= 0.98 clean and >= 0.95 degraded.

:func:`grade` grades a list of (image, prompt) into per-attribute accuracy (on all prompts, on
the combinations the demo trains on, and on those it holds out: see
:data:`pipelines.demo.assets.DEMO_HELD_OUT`) and one row per prompt.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pipelines.demo import assets as demo_assets
from pipelines.embedded import shapes as synthetic

ATTRIBUTES: tuple[str, ...] = ("colour", "shape", "background")
TEMPLATE_SIDE = 16  # the side of the normalised shape masks compared with the templates
TEMPLATE_SAMPLES = 48  # drawn shapes averaged into each template


class Prediction(NamedTuple):
    """One classifier's answer: the label (``None``: nothing recognisable) and its confidence.

    The shape classifier also gives the ``nearest`` template and its ``distance``, which
    stand even when the mask is too far from every template to be labelled.
    """

    label: str | None
    confidence: float
    nearest: str | None = None
    distance: float | None = None


@dataclasses.dataclass(frozen=True)
class GradingOptions:
    """Knobs of the classifiers (RGB distances on 0..255).

    ``border``: width of the border read for the background (``None``: 1/16 of the shorter
    side, at least 1 pixel). ``palette_distance``: a pixel votes for its nearest palette colour
    only when it is this close. ``min_foreground``: the least share of the image that must vote
    for a shape colour, else colour and shape are ``None``. ``shapes``: the shape labels the
    shape classifier chooses among (``None``: the demo's, plus any shape a graded prompt names).
    ``max_shape_distance``: a mask farther than this from every template (mean absolute
    difference on 0..1) is no shape (label ``None``); ``None`` always labels the nearest.
    Ground truth reaches at most 0.075 clean and 0.117 degraded (960 images each); the blobs of
    the first trained demo model mostly lie at 0.15-0.45.
    """

    border: int | None = None
    palette_distance: float = 80.0
    min_foreground: float = 0.005
    shapes: tuple[str, ...] | None = None
    max_shape_distance: float | None = 0.15


# ----------------------------------------------------------------------------------------------
# The classifiers
# ----------------------------------------------------------------------------------------------


def _palette() -> tuple[list[str], np.ndarray]:
    return list(synthetic.COLOURS), np.asarray(list(synthetic.COLOURS.values()), np.float64)


def _nearest(pixels_n3: np.ndarray, colours_k3: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    distances_nk = np.linalg.norm(pixels_n3[:, None, :] - colours_k3[None], axis=-1)
    return distances_nk.argmin(-1), distances_nk.min(-1)


def _check(image: np.ndarray) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"image must be uint8 HxWx3, got {image.dtype} {image.shape}")
    return image


def _border_mask(height: int, width: int, border: int | None) -> np.ndarray:
    border = border or max(1, min(height, width) // 16)
    mask = np.zeros((height, width), bool)
    mask[:border], mask[-border:], mask[:, :border], mask[:, -border:] = True, True, True, True
    return mask


def classify_background(image: np.ndarray, options: GradingOptions = GradingOptions()):
    """The background's palette colour: the nearest palette colour most border pixels have."""
    image = _check(image)
    names, colours = _palette()
    border = image[_border_mask(*image.shape[:2], options.border)].astype(np.float64)
    index, _ = _nearest(border, colours)
    votes = np.bincount(index, minlength=len(names))
    winner = int(votes.argmax())
    return Prediction(names[winner], float(votes[winner] / votes.sum()))


def _colour_votes(image: np.ndarray, background: str, options: GradingOptions):
    """(winner index or None, its share of the votes, the pixels' nearest index, vote mask)."""
    names, colours = _palette()
    pixels = image.reshape(-1, 3).astype(np.float64)
    index, distance = _nearest(pixels, colours)
    voting = (index != names.index(background)) & (distance <= options.palette_distance)
    if voting.mean() < options.min_foreground:
        return None, 0.0, index, voting
    votes = np.bincount(index[voting], minlength=len(names))
    winner = int(votes.argmax())
    return winner, float(votes[winner] / votes.sum()), index, voting


def classify_colour(
    image: np.ndarray, background: str | None = None, options: GradingOptions = GradingOptions()
):
    """The shape's palette colour: the one most non-background pixels are near to."""
    image = _check(image)
    background = background or classify_background(image, options).label
    winner, share, _, _ = _colour_votes(image, background, options)
    return Prediction(None if winner is None else _palette()[0][winner], share)


def _soft_mask(image: np.ndarray, options: GradingOptions) -> np.ndarray | None:
    """Each pixel's place on the line from the measured background to the measured shape
    colour, clipped to [0, 1]; ``None`` when there is no shape colour."""
    image = _check(image)
    height, width = image.shape[:2]
    background = classify_background(image, options).label
    winner, _, index, voting = _colour_votes(image, background, options)
    if winner is None:
        return None
    pixels = image.reshape(-1, 3).astype(np.float64)
    border = _border_mask(height, width, options.border).reshape(-1)
    back_rgb = np.median(pixels[border], axis=0)
    fore_rgb = np.median(pixels[voting & (index == winner)], axis=0)
    axis = fore_rgb - back_rgb
    t = (pixels - back_rgb) @ axis / max(float(axis @ axis), 1e-6)
    return np.clip(t, 0.0, 1.0).reshape(height, width)


def _normalised(mask: np.ndarray) -> np.ndarray | None:
    """The soft mask's largest component, cropped to its bounding box, as TEMPLATE_SIDE^2."""
    from PIL import Image
    from scipy import ndimage

    labels, count = ndimage.label(mask > 0.5, structure=np.ones((3, 3)))
    if count == 0:
        return None
    sizes = np.bincount(labels.reshape(-1))[1:]
    component = labels == 1 + int(sizes.argmax())
    rows, cols = np.nonzero(component)
    top, bottom, left, right = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    near = ndimage.binary_dilation(component, structure=np.ones((3, 3)))
    crop = (mask * near)[top:bottom, left:right].astype(np.float32)
    side = TEMPLATE_SIDE
    return np.asarray(Image.fromarray(crop, mode="F").resize((side, side), Image.BILINEAR))


@functools.cache
def shape_templates(height: int, width: int) -> dict[str, tuple[np.ndarray, ...]]:
    """Per shape of :data:`pipelines.embedded.shapes.SHAPES`, two templates: the mean normalised
    mask of ``TEMPLATE_SAMPLES`` shapes draw_shape draws at ``height`` x ``width``, sharp and
    blurred by :func:`degrade` (a render is often blurred); fixed seed."""
    rng = np.random.default_rng(12345)
    templates = {}
    for shape in synthetic.SHAPES:
        sharp, blurred = [], []
        for _ in range(TEMPLATE_SAMPLES):
            image = np.asarray(synthetic.draw_shape(shape, "white", "black", height, width, rng))
            sharp.append(_normalised(image[..., 0] / 255.0))
            soft = _soft_mask(degrade(image, rng, noise=0.0, shift=0.0), GradingOptions())
            blurred.append(_normalised(soft))
        templates[shape] = (np.mean(sharp, axis=0), np.mean(blurred, axis=0))
    return templates


def classify_shape(
    image: np.ndarray,
    shapes: Sequence[str] | None = None,
    options: GradingOptions = GradingOptions(),
):
    """The nearest shape template to the image's normalised shape mask (see the module doc)."""
    image = _check(image)
    shapes = tuple(shapes or options.shapes or demo_assets.DEMO_SHAPES)
    mask = _soft_mask(image, options)
    normalised = None if mask is None else _normalised(mask)
    if normalised is None:
        return Prediction(None, 0.0)
    templates = shape_templates(*image.shape[:2])
    distances = sorted(
        (min(float(np.abs(normalised - t).mean()) for t in templates[s]), s)
        for s in shapes
        if s in templates
    )
    (best, nearest), margin = distances[0], 1.0
    if len(distances) > 1:
        margin = distances[1][0] - best
    limit = options.max_shape_distance
    label = nearest if limit is None or best <= limit else None
    return Prediction(label, margin, nearest, best)


def classify(
    image: np.ndarray,
    shapes: Sequence[str] | None = None,
    options: GradingOptions = GradingOptions(),
) -> dict[str, Prediction]:
    """All three classifiers: ``{colour, shape, background}`` -> :class:`Prediction`."""
    background = classify_background(image, options)
    return {
        "colour": classify_colour(image, background.label, options),
        "shape": classify_shape(image, shapes, options),
        "background": background,
    }


# ----------------------------------------------------------------------------------------------
# Grading renders against their prompts
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GradeReport:
    """Per-prompt rows and per-attribute accuracy on all / seen / held-out combinations."""

    rows: tuple[dict, ...]

    def accuracy(self, attribute: str, subset: str = "all") -> float | None:
        """Share of rows (``subset``: all, seen, held_out) where ``attribute`` is right;
        ``attribute`` may also be ``all_three``. ``None`` when the subset is empty."""
        rows = [r for r in self.rows if subset == "all" or r["held_out"] == (subset == "held_out")]
        if not rows:
            return None
        if attribute == "all_three":
            return sum(all(r[a]["correct"] for a in ATTRIBUTES) for r in rows) / len(rows)
        return sum(r[attribute]["correct"] for r in rows) / len(rows)

    def to_dict(self) -> dict:
        subsets = ("all", "seen", "held_out")
        return {
            "accuracy": {
                a: {s: self.accuracy(a, s) for s in subsets} for a in (*ATTRIBUTES, "all_three")
            },
            "counts": {
                "all": len(self.rows),
                "held_out": sum(r["held_out"] for r in self.rows),
            },
            "rows": list(self.rows),
        }


def grade(
    images: Sequence[np.ndarray],
    prompts: Sequence[str],
    held_out: Sequence[tuple[str, str, str]] = demo_assets.DEMO_HELD_OUT,
    options: GradingOptions = GradingOptions(),
) -> GradeReport:
    """Classify each image's colour, shape and background and compare with its prompt."""
    if len(images) != len(prompts):
        raise ValueError(f"grade: {len(images)} images but {len(prompts)} prompts")
    parts = [demo_assets.parse_prompt(p) for p in prompts]
    shapes = options.shapes or tuple(
        dict.fromkeys([*demo_assets.DEMO_SHAPES, *(p.shape for p in parts)])
    )
    held = {tuple(c) for c in held_out}
    rows = []
    for image, prompt, expected in zip(images, prompts, parts, strict=True):
        found = classify(image, shapes, options)
        row = {"prompt": prompt, "held_out": tuple(expected) in held}
        for attribute in ATTRIBUTES:
            want, got = getattr(expected, attribute), found[attribute]
            row[attribute] = {
                "expected": want,
                "found": got.label,
                "confidence": round(got.confidence, 4),
                "correct": got.label == want,
            }
            if got.nearest is not None:
                row[attribute]["nearest"] = got.nearest
                row[attribute]["distance"] = round(got.distance, 4)
        rows.append(row)
    return GradeReport(tuple(rows))


# ----------------------------------------------------------------------------------------------
# The classifiers' own accuracy on ground truth
# ----------------------------------------------------------------------------------------------


def degrade(
    image: np.ndarray, rng: np.random.Generator, *, noise: float = 0.05, shift: float = 0.04
) -> np.ndarray:
    """What a 32x32 render does to a clean image, roughly: 2x down-and-up bilinear blur, a
    global per-channel colour shift of up to +-``shift`` and gaussian noise of sigma ``noise``
    (on 0..1 pixels)."""
    from PIL import Image

    height, width = image.shape[:2]
    small = Image.fromarray(image).resize((max(1, width // 2), max(1, height // 2)), Image.BILINEAR)
    blurred = np.asarray(small.resize((width, height), Image.BILINEAR), np.float64) / 255.0
    shifted = blurred + rng.uniform(-shift, shift, size=3)
    noisy = shifted + rng.normal(0.0, noise, size=blurred.shape)
    return np.round(np.clip(noisy, 0.0, 1.0) * 255.0).astype(np.uint8)


def ground_truth(n: int, seed: int, image_size: int = demo_assets.DEMO_IMAGE_SIZE):
    """``n`` (image, prompt) pairs drawn by draw_shape over :func:`demo_combinations`, cycled."""
    rng = np.random.default_rng(seed)
    combos = demo_assets.demo_combinations()
    images, prompts = [], []
    for i in range(n):
        colour, shape, background = combos[i % len(combos)]
        image = synthetic.draw_shape(shape, colour, background, image_size, image_size, rng)
        images.append(np.asarray(image))
        prompts.append(synthetic.caption_for(colour, shape, background))
    return images, prompts


def classifier_accuracy(n: int = 480, seed: int = 0) -> dict[str, dict[str, float]]:
    """Each classifier's accuracy on ``n`` ground-truth images (:func:`ground_truth`), clean
    and degraded (:func:`degrade`): ``{attribute: {"clean": acc, "degraded": acc}}``."""
    images, prompts = ground_truth(n, seed)
    rng = np.random.default_rng(seed + 1)
    degraded = [degrade(im, rng) for im in images]
    clean_report, degraded_report = grade(images, prompts), grade(degraded, prompts)
    return {
        a: {"clean": clean_report.accuracy(a), "degraded": degraded_report.accuracy(a)}
        for a in ATTRIBUTES
    }
