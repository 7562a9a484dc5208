"""LTX-2 image-to-video: what ``LTX2ImageToVideoPipeline`` adds to ``LTX2Pipeline``.

Reference: ``diffusers/pipelines/ltx2/pipeline_ltx2_image2video.py`` (diffusers 0.42). The
family (:class:`jaxcore.families.ltx2.LTX2Family`) renders either pipeline from the same
components; ``model_index.json``'s ``_class_name`` says which (:class:`LTX2PipelineOptions`,
the configs' ``pipeline`` entry). What image-to-video changes:

- the conditioning image is re-compressed as one H.264 frame (libx264, ``crf`` = the prompt's
  ``image_crf``, else :attr:`LTX2PipelineOptions.image_crf`, default
  :data:`DEFAULT_IMAGE_CRF` = 33, the LTX-2.0 to
  2.3 models' training compression; 0 skips it) through PyAV (:func:`recompressed`), resized
  to the render size (PIL bilinear: the pipeline's ``VideoProcessor(resample="bilinear")``),
  VAE-encoded as a one-frame clip (the posterior's mode) and normalised *without*
  ``scaling_factor`` (:func:`jaxcore.models.ltx2_vae.encode_condition_latents`): the first
  latent frame, ``image_latents`` ``[C, 1, H', W']`` per row (:func:`image_latents`);
- the initial video latents are that frame, then the noise (:func:`with_first_frame`: the
  prompt's ``latents`` file or its seed's noise gives the frames after the first; the audio is
  untouched);
- every transformer pass (conditional, negative, modality-isolated, STG) takes the video's
  per-token timesteps ``t (1 - mask)``, 0 on the first frame's tokens
  (:func:`video_timesteps`), the audio's ``t`` and ``sigma = t``;
- guidance (CFG, STG, modality guidance, the rescale) runs on every token, the first frame's
  included, as diffusers guides; then the scheduler steps the frames after the first only.
  Here the first frame's guided velocity is set to 0 (:func:`frozen_first_frame`): the shared
  loop's Euler step ``x + (sigma' - sigma) v`` then keeps it bit for bit.

diffusers applies the re-compression only where it draws the latents itself (``latents=None``;
given latents are taken as they are, the image unused); the family always encodes the image
and takes a prompt's ``latents`` as the noise of the frames after the first. diffusers picks
CRF 18 for an LTX-2.5 (Gemma 4) text encoder; the family loads Gemma-3 only, so 33.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from jaxcore.family_types import options_from_dict

T2V_PIPELINE = "LTX2Pipeline"
I2V_PIPELINE = "LTX2ImageToVideoPipeline"
IMAGE_LATENTS = "image_latents"  # [C, 1, H', W']: the conditioning image's latent frame
DEFAULT_IMAGE_CRF = 33  # diffusers' resolve_default_image_crf for Gemma-3 text encoders
MAX_CRF = 51  # libx264's range is 0..51
# The one-frame H.264 clip diffusers' apply_image_conditioning_crf writes (ltx-pipelines'
# media_io.preprocess): libx264 at the "veryfast" preset, 1 fps, yuv420p, even sides.
X264_PRESET = "veryfast"
# The colour conversions on one thread (the same pixels as diffusers' default): a converter
# with a thread pool that is garbage-collected in a forked child (generate's worker
# processes) waits forever on its threads, which the fork did not copy.
SWSCALE_THREADS = 1


@dataclasses.dataclass(frozen=True)
class LTX2PipelineOptions:
    """What ``model_index.json`` says beyond the components (the pipeline class), and the
    image-to-video re-compression's CRF (``None``: :data:`DEFAULT_IMAGE_CRF`; 0: none).
    ``image_crf`` is a ``__call__`` argument in diffusers: here the pipeline option (a model
    YAML's ``pipeline`` section, or ``pipe.configs["pipeline"]``) is the default of a prompt
    line's ``image_crf``."""

    pipeline_class: str = T2V_PIPELINE
    image_crf: int | None = None

    def __post_init__(self):
        known = (T2V_PIPELINE, I2V_PIPELINE)
        if self.pipeline_class not in known:
            raise ValueError(
                f"pipeline_class={self.pipeline_class!r}: expected one of {list(known)}"
            )
        crf = self.image_crf
        if crf is not None and (
            isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= MAX_CRF
        ):
            raise ValueError(f"image_crf={crf!r}: expected an integer in [0, {MAX_CRF}] or None")

    @property
    def image_to_video(self) -> bool:
        return self.pipeline_class == I2V_PIPELINE

    @property
    def crf(self) -> int:
        """The CRF the image is re-compressed at (0: not re-compressed)."""
        return DEFAULT_IMAGE_CRF if self.image_crf is None else self.image_crf

    @classmethod
    def from_index(cls, index: Mapping) -> LTX2PipelineOptions:
        return cls(pipeline_class=str(index.get("_class_name", T2V_PIPELINE)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> LTX2PipelineOptions:
        return options_from_dict(cls, data)


def options(configs: Mapping) -> LTX2PipelineOptions:
    """The configs' pipeline options (a model YAML without the section: text-to-video)."""
    return configs.get("pipeline", LTX2PipelineOptions())


def recompressed(image, crf: int):
    """A PIL image -> the RGB PIL image one H.264 frame at ``crf`` decodes to (diffusers'
    ``apply_image_conditioning_crf``: libx264 ``preset`` :data:`X264_PRESET`, yuv420p, the
    sides cut to even numbers); ``crf`` 0 returns the image as it is."""
    from PIL import Image

    if crf == 0:
        return image
    try:
        import av
    except ImportError:
        raise ImportError(
            f"image_crf={crf}: re-compressing the conditioning image needs PyAV (pip install "
            "av), or set the pipeline option image_crf=0"
        ) from None
    rgb = np.asarray(image.convert("RGB"), np.uint8)
    height, width = rgb.shape[0] // 2 * 2, rgb.shape[1] // 2 * 2
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream(
            "libx264", rate=1, options={"crf": str(crf), "preset": X264_PRESET}
        )
        stream.height, stream.width = height, width
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb[:height, :width]), "rgb24")
        container.mux(stream.encode(frame.reformat(format="yuv420p", threads=SWSCALE_THREADS)))
        container.mux(stream.encode())  # flush the encoder
    with av.open(io.BytesIO(buffer.getvalue())) as container:
        decoded = next(container.decode(video=0))
        return Image.fromarray(decoded.to_ndarray(format="rgb24", threads=SWSCALE_THREADS))


def pixels(image, height: int, width: int, crf: int) -> np.ndarray:
    """A PIL image -> ``[3, height, width]`` float32 in [-1, 1] as ``LTX2ImageToVideoPipeline``
    prepares it: re-compressed (:func:`recompressed`), PIL bilinear resize to the render size,
    ``/ 255 * 2 - 1``. Images that are not RGB are converted."""
    from PIL import Image

    resized = recompressed(image, crf).resize(
        (width, height), resample=Image.BILINEAR, reducing_gap=None
    )
    if resized.mode != "RGB":
        resized = resized.convert("RGB")
    array = np.asarray(resized, np.float32) / 255.0
    return np.transpose(array * 2.0 - 1.0, (2, 0, 1))


def image_latents(
    vae, params, images: Sequence, height: int, width: int, crf: int | Sequence[int]
) -> np.ndarray:
    """PIL images -> their latent frames ``[B, C, 1, H', W']`` float32 (each encoded alone:
    the VAE is compiled for one image), each re-compressed at ``crf`` (one for all, or one per
    image)."""
    from jaxcore.models import ltx2_vae

    crfs = [crf] * len(images) if isinstance(crf, int) else list(crf)
    rows = []
    for image, image_crf in zip(images, crfs, strict=True):
        batch = pixels(image, height, width, image_crf)[None]
        latents = ltx2_vae.encode_condition_latents(vae, params, batch.astype(vae.dtype))
        rows.append(np.asarray(latents, np.float32)[0])
    return np.stack(rows)


def first_frame_mask(grid: Sequence[int]) -> np.ndarray:
    """``[F' H' W']``: 1 on the first latent frame's tokens (the packed order), 0 elsewhere."""
    frames, height, width = grid
    mask = np.zeros((frames, height * width), np.float32)
    mask[0] = 1.0
    return mask.reshape(-1)


def video_timesteps(timestep_b, grid: Sequence[int]):
    """Per-token video timesteps ``[B, F' H' W']``: ``t (1 - mask)``, as the pipeline's
    ``video_timestep`` (0 on the image's tokens)."""
    keep = jnp.asarray(1.0 - first_frame_mask(grid))
    return timestep_b.astype(jnp.float32)[:, None] * keep[None]


def with_first_frame(latents, image_bc1hw):
    """Latents whose first ``C`` channels are the video (``[B, C(+K), F', ...]``: the loop's
    joint layout or the video alone) with the video's first latent frame set to the image's,
    every other value as it is (jittable)."""
    channels = image_bc1hw.shape[1]
    video = jnp.concatenate(
        [jnp.asarray(image_bc1hw, latents.dtype), latents[:, :channels, 1:]], axis=2
    )
    return jnp.concatenate([video, latents[:, channels:]], axis=1)


def frozen_first_frame(velocity_bcfhw):
    """The video's velocity with the first latent frame's set to 0: the Euler step keeps that
    frame, as diffusers steps the frames after it only."""
    return jnp.asarray(velocity_bcfhw).at[:, :, 0].set(0.0)
