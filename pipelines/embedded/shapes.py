"""A synthetic "coloured shapes" dataset, written as a real on-disk Hugging Face dataset.

Each item is one shape (circle, square, triangle, ...) of one colour on a plain background of
another colour, captioned "a red circle on a blue background". The convert stage reads it like
any other Hugging Face dataset, and the demo checks generated images against the same words
(:data:`COLOURS`, :data:`SHAPES`).

Two on-disk layouts, both loadable with the ``datasets`` library:

- ``imagefolder``: ``NNNNN.png`` files plus ``metadata.jsonl`` (``file_name``, ``text``, ``id``),
  read with ``datasets.load_dataset(directory)``;
- ``save_to_disk``: an Arrow dataset with columns ``image`` (``datasets.Image``), ``text``, ``id``,
  read with ``datasets.load_from_disk(directory)``.

Everything is deterministic from ``seed``. ``corrupt`` items carry bytes that are not an image,
and ``empty_captions`` items an empty caption, so tests can check that bad rows are counted and
skipped; which items are bad is also deterministic.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Literal

import numpy as np

log = logging.getLogger(__name__)

# Colour name -> RGB. Names are plain words a caption (and a prompt check) can use.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 220, 40),
    "purple": (140, 50, 170),
    "orange": (245, 140, 20),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "cross")

CORRUPT_BYTES = b"this is not an image\x00\x01\x02"


def caption_for(colour: str, shape: str, background: str) -> str:
    """The caption of one item: 'a red circle on a blue background'."""
    return f"a {colour} {shape} on a {background} background"


def _shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    """Vertices of a polygonal shape centred at (cx, cy) with 'radius' r."""
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "cross":
        t = r / 3
        return [
            (cx - t, cy - r), (cx + t, cy - r), (cx + t, cy - t), (cx + r, cy - t),
            (cx + r, cy + t), (cx + t, cy + t), (cx + t, cy + r), (cx - t, cy + r),
            (cx - t, cy + t), (cx - r, cy + t), (cx - r, cy - t), (cx - t, cy - t),
        ]  # fmt: skip
    raise ValueError(f"unknown shape {shape!r}; known: {list(SHAPES)}")


def draw_shape(
    shape: str, colour: str, background: str, height: int, width: int, rng: np.random.Generator
):
    """One PIL RGB image: ``shape`` in ``colour`` on a ``background`` field, random size/place."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), COLOURS[background])
    draw = ImageDraw.Draw(image)
    side = min(height, width)
    r = side * rng.uniform(0.2, 0.35)
    cx = rng.uniform(r, width - r)
    cy = rng.uniform(r, height - r)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=COLOURS[colour])
    else:
        draw.polygon(_shape_polygon(shape, cx, cy, r), fill=COLOURS[colour])
    return image


def _png_bytes(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def make_items(
    num_items: int, height: int, width: int, seed: int, corrupt: int = 0, empty_captions: int = 0
) -> list[dict]:
    """The items as dicts ``{id, image_bytes, text, colour, shape, background}``, deterministic.

    The ``corrupt`` bad-image items and ``empty_captions`` empty-caption items are distinct
    items chosen by the seed.
    """
    if num_items < 1:
        raise ValueError(f"num_items must be >= 1, got {num_items}")
    if corrupt < 0 or empty_captions < 0 or corrupt + empty_captions > num_items:
        raise ValueError(
            f"corrupt ({corrupt}) + empty_captions ({empty_captions}) must be between 0 and "
            f"num_items ({num_items})"
        )
    rng = np.random.default_rng(seed)
    bad = rng.permutation(num_items)
    corrupt_ids = set(bad[:corrupt].tolist())
    empty_ids = set(bad[corrupt : corrupt + empty_captions].tolist())
    names = list(COLOURS)
    items = []
    for i in range(num_items):
        colour, background = rng.choice(names, size=2, replace=False).tolist()
        shape = str(rng.choice(SHAPES))
        image = draw_shape(shape, colour, background, height, width, rng)
        items.append(
            {
                "id": f"shape-{seed}-{i:05d}",
                "image_bytes": CORRUPT_BYTES if i in corrupt_ids else _png_bytes(image),
                "text": "" if i in empty_ids else caption_for(colour, shape, background),
                "colour": colour,
                "shape": shape,
                "background": background,
            }
        )
    return items


def make_shapes_dataset(
    directory: str | Path,
    num_items: int,
    height: int = 64,
    width: int = 64,
    seed: int = 0,
    corrupt: int = 0,
    empty_captions: int = 0,
    layout: Literal["imagefolder", "save_to_disk"] = "imagefolder",
) -> Path:
    """Write the shapes dataset to ``directory`` and return it.

    Columns: ``image`` (PNG), ``text`` (caption), ``id`` (stable id), plus ``colour``, ``shape``
    and ``background`` for checks. See the module docstring for the layouts.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = make_items(num_items, height, width, seed, corrupt, empty_captions)
    if layout == "imagefolder":
        _write_imagefolder(directory, items)
    elif layout == "save_to_disk":
        _write_arrow(directory, items)
    else:
        raise ValueError(f"layout must be 'imagefolder' or 'save_to_disk', got {layout!r}")
    log.info("wrote %d synthetic shape items to %s (%s)", num_items, directory, layout)
    return directory


def _write_imagefolder(directory: Path, items: list[dict]) -> None:
    lines = []
    for item in items:
        name = f"{item['id']}.png"
        (directory / name).write_bytes(item["image_bytes"])
        meta = {k: v for k, v in item.items() if k != "image_bytes"}
        lines.append(json.dumps({"file_name": name, **meta}))
    (directory / "metadata.jsonl").write_text("\n".join(lines) + "\n")


def _write_arrow(directory: Path, items: list[dict]) -> None:
    import datasets

    columns = {k: [item[k] for item in items] for k in items[0] if k != "image_bytes"}
    columns["image"] = [
        {"bytes": item["image_bytes"], "path": f"{item['id']}.png"} for item in items
    ]
    features = datasets.Features(
        {
            **{k: datasets.Value("string") for k in columns if k != "image"},
            "image": datasets.Image(),
        }
    )
    datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(directory))
