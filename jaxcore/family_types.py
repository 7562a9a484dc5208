"""The value types the family interface and the pipeline share: errors, tensor specs, media
geometry, guidance and image inputs. A leaf module (no jaxcore import but ``weights``), so
:mod:`jaxcore.pipeline` uses them without importing the families, which build pipelines."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxcore import weights

# SDXL's micro-conditioning, as the diffusers pipeline's __call__ arguments name it: each a
# (height, width) or (top, left) pair of ints
MICRO_CONDITIONING = (
    "original_size",
    "crops_coords_top_left",
    "target_size",
    "negative_original_size",
    "negative_crops_coords_top_left",
    "negative_target_size",
)


class FamilyError(weights.WeightsError):
    """A model directory, config or record set that does not fit a family; names the thing."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A named per-example tensor (no batch axis): a record feature or a conditioning input."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_dict(cls, name: str, data: Mapping) -> TensorSpec:
        return cls(name, tuple(int(n) for n in data["shape"]), str(data.get("dtype", "float32")))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The media sizes a pipeline can encode and render.

    ``spatial_multiple``: height and width must be positive multiples of it (VAE compression x
    the denoiser's patch). ``temporal_multiple``: ``num_frames - 1`` must be a multiple of it;
    0 means images only (``num_frames == 1``).
    """

    spatial_multiple: int
    temporal_multiple: int

    def check(self, height: int, width: int, num_frames: int, where: str = "") -> None:
        """Raise ValueError naming the parameter when a size cannot be used."""
        prefix = f"{where}: " if where else ""
        s = self.spatial_multiple
        for name, value in (("height", height), ("width", width)):
            if not isinstance(value, int) or value < s or value % s:
                raise ValueError(
                    f"{prefix}{name} must be a positive multiple of {s}, got {value!r}"
                )
        t = self.temporal_multiple
        if not isinstance(num_frames, int) or num_frames < 1:
            raise ValueError(f"{prefix}num_frames must be >= 1, got {num_frames!r}")
        if t == 0 and num_frames != 1:
            raise ValueError(
                f"{prefix}num_frames must be 1 (this model makes images), got {num_frames}"
            )
        if t and (num_frames - 1) % t:
            raise ValueError(
                f"{prefix}num_frames must be 1, {1 + t}, {1 + 2 * t}, ... ({t}k + 1), "
                f"got {num_frames}"
            )


@dataclasses.dataclass(frozen=True)
class Guidance:
    """How one prompt is guided: a CFG scale (applied when > 1) and the denoiser's own inputs.

    ``cfg_scale``: ``uncond + cfg_scale * (cond - uncond)`` when > 1 (Wan's ``guidance_scale``,
    Flux's ``true_cfg_scale``). ``embedded``: extra per-sample conditioning scalars the denoiser
    takes as input (Flux dev's guidance embedding), by name. ``cfg_scale_2``: the scale while
    the second expert predicts (Wan 2.2's ``guidance_scale_2``); None without a second expert.
    ``guidance_rescale``: diffusers' ``guidance_rescale`` (SD / SDXL; 0 = off), applied after
    CFG (:func:`jaxcore.sampling.rescale_guidance`).
    """

    cfg_scale: float = 1.0
    embedded: Mapping[str, float] = dataclasses.field(default_factory=dict)
    cfg_scale_2: float | None = None
    guidance_rescale: float = 0.0

    @property
    def uses_cfg(self) -> bool:
        return self.cfg_scale > 1.0


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """Which conditioning images a pipeline takes: ``"none"``, ``"optional"`` (a text-and-image
    model such as Wan 2.2 TI2V) or ``"required"`` (an image-to-video model); and whether it also
    takes a ``last_image`` (first-last-frame to video); ``max_images``: how many images the
    ``image`` slot takes (above 1: a list of reference images, e.g. Flux.2 [klein]'s 1-4, whose
    sizes a batch must share); ``size_from_image``: a prompt with images and no size renders at
    the size :meth:`Family.size_from_image` derives from its first image (Flux2KleinPipeline's
    fallback when ``height`` / ``width`` are None)."""

    image: str = "none"
    last_image: bool = False
    max_images: int = 1
    size_from_image: bool = False

    def check_count(self, count: int, where: str) -> None:
        """Raise ValueError naming ``where`` when a list of ``count`` images does not fit."""
        if self.max_images < 2:
            raise ValueError(
                f"{where}: this model takes one 'image' (a path), not a list of {count}"
            )
        if not 1 <= count <= self.max_images:
            raise ValueError(
                f"{where}: 'image' lists {count} images; this model takes 1 to {self.max_images}"
            )

    def check(self, has_image: bool, has_last_image: bool, where: str) -> None:
        """Raise ValueError naming ``where`` when a prompt's images do not fit the model."""
        if self.image == "required" and not has_image:
            raise ValueError(f"{where}: this model is image-to-video: the prompt needs an 'image'")
        if self.image == "none" and (has_image or has_last_image):
            raise ValueError(f"{where}: this model takes no conditioning image")
        if has_last_image and not self.last_image:
            raise ValueError(f"{where}: this model takes no 'last_image'")
        if has_last_image and not has_image:
            raise ValueError(f"{where}: a 'last_image' needs an 'image'")

    def check_rows(self, images) -> None:
        """:meth:`check` of each row's ``(image, last_image)`` (None where absent), a misfit
        raised as :class:`FamilyError` naming the row."""
        for row, (image, last) in enumerate(images):
            try:
                self.check(image is not None, last is not None, f"row {row}")
            except ValueError as err:
                raise FamilyError(str(err)) from None


def options_from_dict(cls, data: Mapping):
    """A pipeline-options dataclass ``cls`` from a model YAML's ``pipeline:`` section; keys it
    has no field for are a ValueError naming them and the known ones."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"unknown pipeline option(s) {unknown}; known: {known}")
    return cls(**data)
