"""CLIP image preprocessing, as transformers' PIL backend ``CLIPImageProcessorPil`` does it.

What ``WanImageToVideoPipeline.encode_image`` runs is ``CLIPImageProcessor(images=...,
return_tensors="pt")``. In transformers 5, ``CLIPImageProcessor`` is the torchvision backend when
torchvision is installed and falls back to ``CLIPImageProcessorPil`` (with a warning) when it is
not, as in this project's environment; ``CLIPImageProcessor.from_pretrained(dir)`` and
``AutoImageProcessor`` then return a ``CLIPImageProcessorPil`` too. This module reproduces the
PIL backend bit for bit (the same PIL resize, then numpy in the same precision):

1. ``do_convert_rgb``: PIL images with an alpha band (or a ``transparency`` entry) are composited
   onto white with ``PIL.Image.alpha_composite``, others ``convert("RGB")``; uint8 arrays
   [H, W, C] (C = 1: repeated; C = 4: ``round(a * rgb + (1 - a) * 255)``, a = alpha / 255);
2. resize with PIL (``resample``, 3 = bicubic): ``{"shortest_edge": s}`` scales the short side
   to s and the long side to ``int(s * long / short)``; ``{"height", "width"}`` is exact;
3. center crop to ``crop_size`` (top/left offsets floor; zero padding if the image is smaller);
4. rescale in float64 (``x * rescale_factor``), stored as float32;
5. normalize in float32: ``(x - mean) / std`` per channel.

The torchvision backend resizes with ``torchvision.transforms.v2.functional.resize``
(antialiased bicubic on uint8 tensors), not PIL: its pixels differ from these by interpolation
rounding, so it is not what this module matches.

Output: float32 [B, C, crop H, crop W], what ``CLIPVisionEncoder`` takes as ``pixel_values``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import PIL.Image

from jaxcore import weights

# transformers.image_utils.OPENAI_CLIP_MEAN / OPENAI_CLIP_STD.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
CONFIG_NAME = "preprocessor_config.json"
# preprocessor_config.json keys that name classes, not processing.
IGNORED_CONFIG_KEYS = frozenset(
    ("image_processor_type", "feature_extractor_type", "processor_class", "auto_map")
)


class CLIPImageProcessorConfigError(ValueError):
    """A preprocessor_config.json this module cannot reproduce; the message names the key."""


def _size_dict(value, name: str, is_crop: bool) -> dict[str, int]:
    """transformers' ``get_size_dict``: an int is the shortest edge (``size``) or a square
    (``crop_size``); a dict has ``height`` and ``width``, or (``size`` only) ``shortest_edge``."""
    if isinstance(value, int) and not isinstance(value, bool):
        if is_crop:
            return {"height": value, "width": value}
        return {"shortest_edge": value}
    if isinstance(value, Mapping):
        keys = set(value)
        if keys == {"height", "width"} or (keys == {"shortest_edge"} and not is_crop):
            out = {k: value[k] for k in sorted(keys)}
            if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in out.values()):
                return out
    forms = "a positive int or {'height': h, 'width': w}"
    if not is_crop:
        forms += " or {'shortest_edge': n}"
    raise CLIPImageProcessorConfigError(f"{name} must be {forms}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class CLIPImageProcessorConfig:
    """The ``preprocessor_config.json`` fields of ``CLIPImageProcessor``; defaults are its
    class defaults (OpenAI CLIP's 224 px preprocessing)."""

    do_resize: bool = True
    size: Mapping[str, int] = dataclasses.field(default_factory=lambda: {"shortest_edge": 224})
    resample: int = PIL.Image.Resampling.BICUBIC.value
    do_center_crop: bool = True
    crop_size: Mapping[str, int] = dataclasses.field(
        default_factory=lambda: {"height": 224, "width": 224}
    )
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_convert_rgb: bool = True

    def __post_init__(self):
        object.__setattr__(self, "size", _size_dict(self.size, "size", False))
        object.__setattr__(self, "crop_size", _size_dict(self.crop_size, "crop_size", True))
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            value = (value,) if isinstance(value, int | float) else value
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if any(s == 0 for s in self.image_std):
            raise CLIPImageProcessorConfigError("image_std has a zero entry")
        try:
            PIL.Image.Resampling(self.resample)
        except ValueError:
            raise CLIPImageProcessorConfigError(
                f"resample {self.resample!r} is not a PIL resampling filter (3 = bicubic)"
            ) from None

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every processed image, or None when it depends on the input."""
        if self.do_center_crop:
            return self.crop_size["height"], self.crop_size["width"]
        if self.do_resize and "height" in self.size:
            return self.size["height"], self.size["width"]
        return None

    @classmethod
    def from_dict(cls, raw: Mapping[str, object]) -> CLIPImageProcessorConfig:
        """From a ``preprocessor_config.json`` dict; an unknown key is an error naming it."""
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in raw.items():
            if key in fields:
                kwargs[key] = value
            elif key.startswith("_") or key in IGNORED_CONFIG_KEYS:
                continue
            else:
                raise CLIPImageProcessorConfigError(
                    f"unknown CLIPImageProcessor key {key!r}; known: {sorted(fields)}"
                )
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> CLIPImageProcessorConfig:
        """From ``directory/preprocessor_config.json`` (a pipeline's ``image_processor``)."""
        return cls.from_dict(weights.read_config(directory, CONFIG_NAME))


# --- steps -------------------------------------------------------------------------------------


def to_rgb(image) -> np.ndarray:
    """[H, W, 3] uint8 from a PIL image or a uint8 array [H, W] / [H, W, 1|3|4]."""
    if isinstance(image, PIL.Image.Image):
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return np.array(PIL.Image.alpha_composite(white, rgba).convert("RGB"))
        return np.array(image.convert("RGB"))
    hwc = as_hwc_uint8(image)
    channels = hwc.shape[-1]
    if channels == 1:
        return np.repeat(hwc, 3, axis=-1)
    if channels == 4:
        alpha = hwc[..., 3:4] / 255
        composite = alpha * hwc[..., :3] + (1 - alpha) * 255
        return np.round(composite).astype(np.uint8)
    return hwc


def as_hwc_uint8(image) -> np.ndarray:
    """A PIL image or uint8 array as [H, W, C] uint8, without any colour conversion."""
    array = np.array(image) if isinstance(image, PIL.Image.Image) else np.asarray(image)
    if array.dtype != np.uint8:
        raise TypeError(
            f"images must be PIL images or uint8 arrays [H, W(, C)], got dtype {array.dtype}"
        )
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"an image array must be [H, W] or channels-last [H, W, 1|3|4], got {array.shape}"
        )
    return array


def resize_output_size(height: int, width: int, size: Mapping[str, int]) -> tuple[int, int]:
    """(height, width) after resizing; transformers' ``get_resize_output_image_size`` with
    ``default_to_square=False`` for ``shortest_edge`` (the long side is truncated)."""
    if "height" in size:
        return size["height"], size["width"]
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def resize(hwc: np.ndarray, size: tuple[int, int], resample: int) -> np.ndarray:
    """PIL resize of a uint8 [H, W, C] image to ``size`` = (height, width)."""
    squeeze = hwc.shape[-1] == 1
    image = PIL.Image.fromarray(hwc[..., 0] if squeeze else hwc)
    out = np.array(image.resize((size[1], size[0]), resample=PIL.Image.Resampling(resample)))
    return out[..., None] if squeeze else out


def center_crop(chw: np.ndarray, height: int, width: int) -> np.ndarray:
    """transformers' ``center_crop`` of [C, H, W]: floor offsets, zero padding if too small."""
    orig_h, orig_w = chw.shape[-2:]
    top, left = (orig_h - height) // 2, (orig_w - width) // 2
    if top >= 0 and left >= 0:
        return chw[..., top : top + height, left : left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros(chw.shape[:-2] + (new_h, new_w), chw.dtype)
    top_pad, left_pad = -(-(new_h - orig_h) // 2), -(-(new_w - orig_w) // 2)
    padded[..., top_pad : top_pad + orig_h, left_pad : left_pad + orig_w] = chw
    top, left = top + top_pad, left + left_pad
    return padded[
        ..., max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)
    ]


def rescale(chw: np.ndarray, factor: float) -> np.ndarray:
    """``x * factor`` in float64, stored as float32 (transformers' ``rescale``)."""
    return (chw.astype(np.float64) * factor).astype(np.float32)


def normalize(chw: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``(x - mean) / std`` per channel, in float32 (transformers' ``normalize``)."""
    if len(mean) != chw.shape[0] or len(std) != chw.shape[0]:
        raise ValueError(
            f"image_mean/image_std have {len(mean)}/{len(std)} entries for {chw.shape[0]} channels"
        )
    x = chw if np.issubdtype(chw.dtype, np.floating) else chw.astype(np.float32)
    mean_c = np.asarray(mean, x.dtype)[:, None, None]
    std_c = np.asarray(std, x.dtype)[:, None, None]
    return (x - mean_c) / std_c


# --- pipeline ----------------------------------------------------------------------------------


def preprocess_image(image, config: CLIPImageProcessorConfig) -> np.ndarray:
    """One PIL image or uint8 array -> [C, H, W] (float32 when rescaled or normalized)."""
    hwc = to_rgb(image) if config.do_convert_rgb else as_hwc_uint8(image)
    if config.do_resize:
        hwc = resize(hwc, resize_output_size(*hwc.shape[:2], config.size), config.resample)
    chw = np.moveaxis(hwc, -1, 0)
    if config.do_center_crop:
        chw = center_crop(chw, config.crop_size["height"], config.crop_size["width"])
    if config.do_rescale:
        chw = rescale(chw, config.rescale_factor)
    if config.do_normalize:
        chw = normalize(chw, config.image_mean, config.image_std)
    return chw


def preprocess(images, config: CLIPImageProcessorConfig | None = None) -> np.ndarray:
    """A PIL image, a uint8 array, or a sequence of them -> float32 [B, C, H, W].

    ``CLIPImageProcessor(images=images, return_tensors="pt")["pixel_values"]`` of transformers'
    PIL backend, as numpy. The images must come out the same size (a center crop or an exact
    ``size`` ensures it).
    """
    config = config or CLIPImageProcessorConfig()
    single = isinstance(images, PIL.Image.Image) or (
        isinstance(images, np.ndarray) and images.ndim in (2, 3)
    )
    batch = [images] if single else list(_as_list(images))
    if not batch:
        raise ValueError("no images to preprocess")
    processed = [preprocess_image(image, config) for image in batch]
    shapes = {p.shape for p in processed}
    if len(shapes) > 1:
        raise ValueError(
            f"processed images differ in shape {sorted(shapes)}; enable do_center_crop or give "
            "an exact size to batch them"
        )
    return np.stack(processed).astype(np.float32, copy=False)


def _as_list(images) -> Iterable:
    if isinstance(images, np.ndarray) and images.ndim == 4:
        return list(images)
    if isinstance(images, list | tuple):
        return images
    raise TypeError(
        f"images must be a PIL image, a uint8 array or a list of them, got {type(images)}"
    )
