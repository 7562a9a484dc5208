"""A prompt line's ControlNet fields: validation, defaults, the images (and edge maps) they name.

Fields (a ``.jsonl`` line; each falls back to the config's ``control`` section, then to
diffusers' defaults), with diffusers' ``__call__`` names and broadcasting:

- ``control_image``: a path (relative to the prompt file, absolute or gs://), or a list of
  them: one per ControlNet, or for a union ControlNet one per ``control_mode``.
- ``controlnet_conditioning_scale``: a number (every image) or one per image; default 1.
- ``control_guidance_start`` / ``control_guidance_end``: a number or one per image (one list
  and one number: the number repeats); defaults 0 and 1.
- ``guess_mode``: true / false (default false).
- ``control_mode``: an int or a list of ints (union ControlNets only), one per image.
- ``control_preprocess``: ``{"kind": "canny", "low": 100, "high": 200}`` applied to every
  control image of the line before the ControlNet sees it (:mod:`jaxcore.control_preprocess`,
  equal to ``cv2.Canny``), or null for none; the result is stored beside the render as
  ``outputs/<name>.control.png`` (``.control_<k>.png`` for several images).

A line with control fields but no ``control_image`` is refused by name, as is a model without
ControlNets given one. Sizes a line and the config leave unset come from the first control
image, rounded down to the model's size multiple, where the family's pipelines do so
(StableDiffusion(XL)ControlNetPipeline).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxcore.control_preprocess import ControlPreprocess
from stages.common.errors import StageInputError
from stages.generate.images import read_image

IMAGE = "control_image"
SCALE = "controlnet_conditioning_scale"
START, END = "control_guidance_start", "control_guidance_end"
GUESS, MODE, PREPROCESS = "guess_mode", "control_mode", "control_preprocess"
FIELDS = (IMAGE, SCALE, START, END, GUESS, MODE, PREPROCESS)
DIFFUSERS_DEFAULTS = {SCALE: 1.0, START: 0.0, END: 1.0, GUESS: False}


@dataclasses.dataclass(frozen=True)
class ControlSpec:
    """One prompt's resolved control inputs, one entry per image (hashable, recordable)."""

    images: tuple[str, ...]  # URIs
    scales: tuple[float, ...]
    starts: tuple[float, ...]
    ends: tuple[float, ...]
    guess_mode: bool = False
    modes: tuple[int, ...] = ()
    preprocess: ControlPreprocess | None = None
    size_from_image: bool = False  # the render size comes from the first image

    def entry(self) -> dict:
        """As the record and the fingerprint hold it."""
        out = {
            IMAGE: list(self.images),
            SCALE: list(self.scales),
            START: list(self.starts),
            END: list(self.ends),
            GUESS: self.guess_mode,
        }
        if self.modes:
            out[MODE] = list(self.modes)
        if self.preprocess is not None:
            out[PREPROCESS] = dataclasses.asdict(self.preprocess)
        return out


def check_field(field: str, value, where: str):
    """A control field's JSON type (values are checked when resolved)."""
    if field == IMAGE:
        paths = value if isinstance(value, list) else [value]
        if not paths or not all(isinstance(p, str) and p for p in paths):
            raise StageInputError(f"{where}: {IMAGE} must be a path or a non-empty list of paths")
        return value
    if field in (SCALE, START, END):
        numbers = value if isinstance(value, list) else [value]
        ok = numbers and all(_is_number(v) for v in numbers)
        if not ok:
            raise StageInputError(f"{where}: {field} must be a number or a list of numbers")
        return value
    if field == GUESS:
        if not isinstance(value, bool):
            raise StageInputError(f"{where}: {GUESS} must be true or false, got {value!r}")
        return value
    if field == MODE:
        modes = value if isinstance(value, list) else [value]
        if not modes or not all(isinstance(m, int) and not isinstance(m, bool) for m in modes):
            raise StageInputError(f"{where}: {MODE} must be an int or a list of ints")
        if min(modes) < 0:
            raise StageInputError(f"{where}: {MODE} must not be negative, got {value!r}")
        return value
    if value is None:  # control_preprocess: null = none
        return None
    try:
        return ControlPreprocess.from_dict(value, f"{where}: {PREPROCESS}")
    except ValueError as err:
        raise StageInputError(str(err)) from None


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _per_image(name: str, value, count: int, where: str) -> tuple[float, ...]:
    """A number repeated over the images, or a list with one entry per image."""
    if not isinstance(value, list | tuple):
        return (float(value),) * count
    if len(value) != count:
        raise StageInputError(f"{where}: {name} has {len(value)} entries for {count} image(s)")
    return tuple(float(v) for v in value)


def resolve(given: Mapping[str, Any], section, resolve_path, where: str, sized: bool):
    """The line's :class:`ControlSpec` (None without control fields); ``section`` the config's
    ``control`` defaults, ``resolve_path`` the prompt file's path resolver, ``sized`` whether
    the line or the config set the render size."""
    present = [f for f in FIELDS if f in given]
    if IMAGE not in given:
        if present:
            raise StageInputError(f"{where}: {present[0]} needs a {IMAGE}")
        return None
    paths = given[IMAGE] if isinstance(given[IMAGE], list) else [given[IMAGE]]
    count = len(paths)
    value = functools.partial(_value, given, section)
    modes = given.get(MODE, ())
    modes = tuple(modes) if isinstance(modes, list) else (modes,) if modes != () else ()
    if modes and len(modes) != count:
        raise StageInputError(f"{where}: {MODE} has {len(modes)} entries for {count} image(s)")
    starts, ends = _window(value(START), value(END), count, where)
    for s, e in zip(starts, ends, strict=True):
        if not 0.0 <= s < e <= 1.0:
            raise StageInputError(
                f"{where}: {START} {s} must be below {END} {e}, both in [0, 1] (diffusers' check)"
            )
    preprocess = given.get(PREPROCESS, section.preprocess_spec)
    return ControlSpec(
        images=tuple(resolve_path(p) for p in paths),
        scales=_per_image(SCALE, value(SCALE), count, where),
        starts=starts,
        ends=ends,
        guess_mode=bool(value(GUESS)),
        modes=modes,
        preprocess=preprocess,
        size_from_image=not sized,
    )


def _value(given, section, field):
    """The line's value, else the config's, else diffusers' default."""
    if field in given:
        return given[field]
    configured = getattr(section, field, None)
    return DIFFUSERS_DEFAULTS[field] if configured is None else configured


def _window(start, end, count: int, where: str) -> tuple[tuple, tuple]:
    """diffusers' broadcasting: one list and one number -> the number repeats; two numbers ->
    one pair per image."""
    return _per_image(START, start, count, where), _per_image(END, end, count, where)


# --- images ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def control_image(uri: str, preprocess: ControlPreprocess | None, where: str):
    """(the control image as the ControlNet takes it: preprocessed when asked; its file's
    bytes). Cached: the render and the writer of a prompt both read it."""
    image, data = read_image(uri, where)
    if preprocess is not None:
        image = preprocess.apply(image)
    return image, data


def images_of(spec) -> list:
    """A prompt's control images (PIL), preprocessed."""
    where = f"line {spec.line} (id {spec.id!r})"
    control = spec.control
    return [control_image(uri, control.preprocess, where)[0] for uri in control.images]


def to_input(spec):
    """The prompt's :class:`jaxcore.control.ControlInput`."""
    from jaxcore.control import ControlInput

    c = spec.control
    return ControlInput(tuple(images_of(spec)), c.scales, c.starts, c.ends, c.guess_mode, c.modes)


def check_files(specs: Sequence, checksums: dict) -> None:
    """Before rendering: every control image reads (and preprocesses); their sha256 join
    ``checksums`` (a changed file re-renders its prompts on resume)."""
    import hashlib

    for spec in specs:
        if spec.control is None:
            continue
        where = f"line {spec.line} (id {spec.id!r})"
        for uri in spec.control.images:
            if uri not in checksums:
                data = control_image(uri, spec.control.preprocess, where)[1]
                checksums[uri] = hashlib.sha256(data).hexdigest()


def sized_from_images(specs: Sequence, geometry) -> list:
    """Specs whose size comes from their first control image: its size rounded down to the
    model's multiple (diffusers' ``get_default_height_width`` with the VAE factor)."""
    out = []
    for spec in specs:
        if spec.control is None or not spec.control.size_from_image:
            out.append(spec)
            continue
        first = images_of(spec)[0]
        multiple = geometry.spatial_multiple
        height = first.height - first.height % multiple
        width = first.width - first.width % multiple
        if height < multiple or width < multiple:
            raise StageInputError(
                f"line {spec.line} (id {spec.id!r}): control image {spec.control.images[0]} "
                f"is {first.width}x{first.height}, below the model's multiple {multiple}"
            )
        out.append(dataclasses.replace(spec, height=height, width=width))
    return out


def write_edge_maps(root: str, spec) -> list[str]:
    """The preprocessed control images beside the render (only where preprocessing ran)."""
    from jaxcore import storage
    from stages.generate import outputs

    if spec.control is None or spec.control.preprocess is None:
        return []
    import numpy as np

    images = images_of(spec)
    paths = []
    for k, image in enumerate(images):
        suffix = "control" if len(images) == 1 else f"control_{k}"
        path = f"{outputs.OUTPUTS}/{spec.name}.{suffix}.png"
        storage.write_bytes(storage.join(root, path), outputs.encode_png(np.asarray(image)))
        paths.append(path)
    return paths
